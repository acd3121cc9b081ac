// Tests of the safetensors reader and writer (mdist/hf/safetensors.h).
#include "mdist/hf/safetensors.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using mdist::hf::SafetensorsCheckpoint;
using mdist::hf::SafetensorsError;
using mdist::hf::SafetensorsFile;
using ::testing::HasSubstr;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("mdist-safetensors-" + std::to_string(::getpid()) + "-" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A file of an 8-byte length, `header` and `data`; `length` overrides the written length.
  fs::path raw_file(const std::string& header, const std::string& data = "",
                    std::optional<std::uint64_t> length = std::nullopt) {
    const fs::path path = dir_ / ("raw" + std::to_string(counter_++) + ".safetensors");
    std::ofstream out(path, std::ios::binary);
    const std::uint64_t n = length.value_or(header.size());
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
    out << header << data;
    return path;
  }
  void write_text(const fs::path& path, const std::string& text) {
    std::ofstream out(path, std::ios::binary);
    out << text;
  }
  static std::string read_text(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream buffer;
    buffer << in.rdbuf();
    return buffer.str();
  }
  std::vector<std::string> dir_entries(const fs::path& dir) const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  // Opening `path` throws a one-line SafetensorsError naming the file and containing `text`.
  void expect_open_error(const fs::path& path, const std::string& text) {
    try {
      SafetensorsFile file(path);
      ADD_FAILURE() << "no error for " << text;
    } catch (const SafetensorsError& e) {
      const std::string message = e.what();
      EXPECT_THAT(message, HasSubstr(text));
      EXPECT_THAT(message, HasSubstr(path.filename().string()));
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
  }
  void expect_header_error(const std::string& header, const std::string& data,
                           const std::string& text) {
    expect_open_error(raw_file(header, data), text);
  }

  fs::path dir_;
  int counter_ = 0;
};

// Bit-exact equality, whatever the dtype (NaNs included).
void expect_same_bits(const at::Tensor& actual, const at::Tensor& expected) {
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type());
  ASSERT_EQ(actual.sizes(), expected.sizes());
  const at::Tensor a = actual.contiguous();
  const at::Tensor b = expected.contiguous();
  ASSERT_EQ(a.nbytes(), b.nbytes());
  if (a.nbytes() > 0) {
    EXPECT_EQ(std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()), 0);
  }
}

// Random bytes viewed as `dtype`: every bit pattern, and every dtype, without kernels.
at::Tensor random_tensor(c10::ScalarType dtype, std::vector<std::int64_t> shape) {
  std::int64_t numel = 1;
  for (auto d : shape) numel *= d;
  const auto item = static_cast<std::int64_t>(c10::elementSize(dtype));
  at::Tensor bytes = at::randint(0, 256, {numel * item}, at::kByte);
  if (dtype == at::kBool) bytes = bytes.remainder(2);
  return bytes.view(dtype).reshape(shape);
}

const std::vector<c10::ScalarType> kAllDtypes = {
    at::kDouble, at::kFloat,  at::kHalf,   at::kBFloat16,      at::kLong,
    at::kInt,    at::kShort,  at::kChar,   at::kByte,          at::kBool,
    at::kUInt16, at::kUInt32, at::kUInt64, at::kFloat8_e4m3fn, at::kFloat8_e5m2};

TEST_F(SafetensorsTest, RoundTripsEveryDtypeBitExactly) {
  std::map<std::string, at::Tensor> tensors;
  for (auto dtype : kAllDtypes) {
    tensors["t_" + mdist::hf::dtype_name(dtype)] = random_tensor(dtype, {3, 5});
  }
  const fs::path path = dir_ / "all.safetensors";
  mdist::hf::save_safetensors(path, tensors);
  SafetensorsFile file(path);
  std::vector<std::string> expected_names;
  for (const auto& entry : tensors) expected_names.push_back(entry.first);
  EXPECT_EQ(file.names(), expected_names);
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    EXPECT_EQ(file.info(name).dtype, t.scalar_type());
    EXPECT_EQ(file.info(name).shape, t.sizes().vec());
    expect_same_bits(file.tensor(name), t);
  }
  // The data starts 8-aligned and every tensor is aligned to its element size.
  const std::string bytes = read_text(path);
  std::uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  EXPECT_EQ((8 + header) % 8, 0u);
  for (const auto& name : file.names()) {
    EXPECT_EQ(file.info(name).begin % c10::elementSize(file.info(name).dtype), 0u) << name;
  }
}

TEST_F(SafetensorsTest, RoundTripsZeroDimEmptyAndNonContiguous) {
  const at::Tensor strided = at::arange(12, at::kFloat).reshape({3, 4}).t();
  std::map<std::string, at::Tensor> tensors = {
      {"scalar", at::tensor(3.5, at::kDouble).reshape({})},
      {"empty", at::empty({0, 4}, at::kFloat)},
      {"empty_1d", at::empty({0}, at::kLong)},
      {"strided", strided},
  };
  const fs::path path = dir_ / "shapes.safetensors";
  mdist::hf::save_safetensors(path, tensors);
  SafetensorsFile file(path);
  EXPECT_EQ(file.tensor("scalar").dim(), 0);
  EXPECT_EQ(file.tensor("scalar").item<double>(), 3.5);
  EXPECT_EQ(file.tensor("empty").sizes(), (std::vector<std::int64_t>{0, 4}));
  EXPECT_EQ(file.tensor("empty_1d").numel(), 0);
  expect_same_bits(file.tensor("strided"), strided);
  EXPECT_TRUE(file.metadata().empty());
}

TEST_F(SafetensorsTest, RoundTripsMetadata) {
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "a \"b\"\n"}};
  const fs::path path = dir_ / "meta.safetensors";
  mdist::hf::save_safetensors(path, {{"x", at::ones({2})}}, metadata);
  EXPECT_EQ(SafetensorsFile(path).metadata(), metadata);
}

TEST_F(SafetensorsTest, AlignedTensorsAliasTheMappingAndOutliveTheFile) {
  const fs::path path = dir_ / "alias.safetensors";
  const at::Tensor w = at::arange(64, at::kFloat).reshape({8, 8});
  mdist::hf::save_safetensors(path, {{"w", w}, {"b", at::arange(3, at::kByte)}});
  at::Tensor t;
  {
    SafetensorsFile file(path);
    t = file.tensor("w");
    const auto* begin = static_cast<const char*>(file.mapping_data());
    const auto* p = static_cast<const char*>(t.data_ptr());
    EXPECT_GE(p, begin);
    EXPECT_LE(p + t.nbytes(), begin + file.mapping_size());
  }
  // The mapping stays alive while the tensor does.
  EXPECT_TRUE(at::equal(t, w));
}

// Resident KiB of the mapping that contains `address` (its "Rss:" line in /proc/self/smaps).
std::int64_t resident_kib_of_mapping(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  const auto target = reinterpret_cast<std::uintptr_t>(address);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    std::uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream range(line);
    if (range >> std::hex >> begin >> dash >> end && dash == '-') {
      inside = begin <= target && target < end;
    } else if (inside && line.rfind("Rss:", 0) == 0) {
      return std::stoll(line.substr(4));
    }
  }
  return -1;
}

TEST_F(SafetensorsTest, ReleasePagesDropsResidentPagesAndKeepsTheData) {
  const fs::path path = dir_ / "release.safetensors";
  const at::Tensor w = at::arange(1 << 20, at::kFloat).reshape({1024, 1024});  // 4 MiB
  mdist::hf::save_safetensors(path, {{"w", w}});
  const SafetensorsFile file(path);
  const at::Tensor t = file.tensor("w");
  EXPECT_TRUE(at::equal(t, w));  // touches every page
  EXPECT_GE(resident_kib_of_mapping(file.mapping_data()), 4096);
  file.release_pages("w");
  EXPECT_LT(resident_kib_of_mapping(file.mapping_data()), 64);
  EXPECT_TRUE(at::equal(t, w));  // read again from the file
}

TEST_F(SafetensorsTest, UnalignedTensorsAreCopied) {
  // A u8 at [0, 1) puts the f32 at data offset 1, which no mapping can align.
  std::string header = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                       R"("f":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})";
  header.append((8 - (8 + header.size()) % 8) % 8, ' ');
  std::string data(9, '\0');
  data[0] = 7;
  const float values[2] = {1.5f, -2.0f};
  std::memcpy(data.data() + 1, values, sizeof(values));
  const fs::path path = raw_file(header, data);
  SafetensorsFile file(path);
  at::Tensor f = file.tensor("f");
  const auto* begin = static_cast<const char*>(file.mapping_data());
  const auto* p = static_cast<const char*>(f.data_ptr());
  EXPECT_TRUE(p < begin || p >= begin + file.mapping_size());
  EXPECT_EQ(f[0].item<float>(), 1.5f);
  EXPECT_EQ(f[1].item<float>(), -2.0f);
  f.add_(1);  // a copy is writable
  EXPECT_EQ(file.tensor("f")[0].item<float>(), 1.5f);
  EXPECT_EQ(file.tensor("a")[0].item<std::uint8_t>(), 7);
}

TEST_F(SafetensorsTest, ReadRowsReturnsExactlyThoseRows) {
  const at::Tensor w = at::arange(5 * 3 * 2, at::kLong).reshape({5, 3, 2});
  const at::Tensor v = at::arange(7, at::kBFloat16);
  const fs::path path = dir_ / "rows.safetensors";
  mdist::hf::save_safetensors(path, {{"w", w}, {"v", v}, {"s", at::scalar_tensor(1.0)}});
  SafetensorsFile file(path);
  for (std::int64_t first = 0; first <= 5; ++first) {
    for (std::int64_t rows = 0; first + rows <= 5; ++rows) {
      expect_same_bits(file.read_rows("w", first, rows), w.slice(0, first, first + rows));
    }
  }
  expect_same_bits(file.read_rows("v", 2, 3), v.slice(0, 2, 5));
  at::Tensor rows = file.read_rows("w", 1, 2);
  rows.add_(1);  // a fresh copy
  expect_same_bits(file.read_rows("w", 1, 2), w.slice(0, 1, 3));
  for (auto [first, count] :
       std::vector<std::pair<std::int64_t, std::int64_t>>{{4, 2}, {-1, 1}, {0, -1}, {6, 0}}) {
    try {
      (void)file.read_rows("w", first, count);
      ADD_FAILURE() << first << " " << count;
    } catch (const SafetensorsError& e) {
      EXPECT_THAT(e.what(), HasSubstr("are outside its 5 rows"));
    }
  }
  EXPECT_THROW(
      {
        try {
          (void)file.read_rows("s", 0, 1);
        } catch (const SafetensorsError& e) {
          EXPECT_THAT(e.what(), HasSubstr("which is 0-d"));
          throw;
        }
      },
      SafetensorsError);
}

TEST_F(SafetensorsTest, SingleFileCheckpointWhenItFits) {
  std::map<std::string, at::Tensor> tensors = {{"a", at::arange(4, at::kFloat)},
                                               {"b", at::arange(6, at::kInt).reshape({2, 3})}};
  mdist::hf::save_checkpoint(dir_ / "ckpt", tensors, 1 << 20);
  EXPECT_EQ(dir_entries(dir_ / "ckpt"), std::vector<std::string>{"model.safetensors"});
  SafetensorsCheckpoint ckpt(dir_ / "ckpt");
  EXPECT_EQ(ckpt.num_files(), 1u);
  EXPECT_EQ(ckpt.names(), (std::vector<std::string>{"a", "b"}));
  for (const auto& [name, t] : tensors) expect_same_bits(ckpt.tensor(name), t);
  EXPECT_EQ(ckpt.file_of("a").metadata().at("format"), "pt");
}

TEST_F(SafetensorsTest, ShardedCheckpointRoundTrips) {
  std::map<std::string, at::Tensor> tensors;
  std::uint64_t total = 0;
  for (int i = 0; i < 7; ++i) {
    at::Tensor t = at::arange(10 * (i + 1), at::kFloat).reshape({i + 1, 10}) + i;
    total += static_cast<std::uint64_t>(t.nbytes());
    tensors["layer." + std::to_string(i) + ".weight"] = t;
  }
  tensors["big"] = at::arange(1000, at::kDouble);  // larger than a shard: alone
  total += 8000;
  const fs::path ckpt_dir = dir_ / "sharded";
  // A stale single file from an earlier save must not shadow the new index.
  mdist::hf::save_checkpoint(ckpt_dir, {{"old", at::ones({1})}}, 1 << 20);
  mdist::hf::save_checkpoint(ckpt_dir, tensors, 600);

  const auto entries = dir_entries(ckpt_dir);
  ASSERT_FALSE(entries.empty());
  EXPECT_EQ(entries.back(), "model.safetensors.index.json");
  const std::size_t shards = entries.size() - 1;
  EXPECT_GE(shards, 3u);
  for (std::size_t i = 0; i < shards; ++i) {
    char expected[64];
    std::snprintf(expected, sizeof(expected), "model-%05zu-of-%05zu.safetensors", i + 1, shards);
    EXPECT_EQ(entries[i], expected);
    EXPECT_LE(SafetensorsFile(ckpt_dir / expected).names().size(), 7u);
  }
  const std::string index = read_text(ckpt_dir / "model.safetensors.index.json");
  EXPECT_THAT(index, HasSubstr("\"total_size\": " + std::to_string(total)));
  EXPECT_THAT(index, HasSubstr("\"weight_map\""));

  SafetensorsCheckpoint ckpt(ckpt_dir);
  EXPECT_EQ(ckpt.num_files(), shards);
  std::vector<std::string> names;
  for (const auto& entry : tensors) names.push_back(entry.first);
  EXPECT_EQ(ckpt.names(), names);
  for (const auto& [name, t] : tensors) {
    expect_same_bits(ckpt.tensor(name), t);
    EXPECT_EQ(ckpt.info(name).shape, t.sizes().vec());
  }
  expect_same_bits(ckpt.read_rows("layer.6.weight", 2, 3),
                   tensors["layer.6.weight"].slice(0, 2, 5));

  // And back to a single file: the stale index is removed.
  mdist::hf::save_checkpoint(ckpt_dir, {{"x", at::ones({2})}}, 1 << 20);
  EXPECT_FALSE(fs::exists(ckpt_dir / "model.safetensors.index.json"));
  EXPECT_EQ(SafetensorsCheckpoint(ckpt_dir).names(), std::vector<std::string>{"x"});
}

TEST_F(SafetensorsTest, FailedWriteLeavesNoFileAndKeepsTheOldOne) {
  const fs::path path = dir_ / "model.safetensors";
  mdist::hf::save_safetensors(path, {{"good", at::arange(3, at::kFloat)}});
  const std::string before = read_text(path);
  // An unsupported dtype fails before anything is written.
  try {
    mdist::hf::save_safetensors(path,
                                {{"a", at::ones({2})}, {"z", at::ones({2}, at::kComplexFloat)}});
    ADD_FAILURE() << "complex tensor was accepted";
  } catch (const SafetensorsError& e) {
    EXPECT_THAT(e.what(), HasSubstr("tensor \"z\" has dtype ComplexFloat"));
  }
  EXPECT_EQ(read_text(path), before);
  EXPECT_EQ(dir_entries(dir_), std::vector<std::string>{"model.safetensors"});
  EXPECT_THROW(mdist::hf::save_safetensors(path, {{"__metadata__", at::ones({1})}}),
               SafetensorsError);

  // The final rename fails (the target is a non-empty directory): the temporary file, written
  // in the same directory, is removed and nothing appears under the final name.
  const fs::path blocked = dir_ / "blocked.safetensors";
  fs::create_directories(blocked / "inside");
  try {
    mdist::hf::save_safetensors(blocked, {{"a", at::ones({2})}});
    ADD_FAILURE() << "rename over a directory succeeded";
  } catch (const SafetensorsError& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot rename"));
    EXPECT_THAT(e.what(), HasSubstr(".blocked.safetensors.tmp."));
  }
  EXPECT_EQ(dir_entries(dir_),
            (std::vector<std::string>{"blocked.safetensors", "model.safetensors"}));

  // A sharded save whose index cannot be renamed leaves no index and no temporary files.
  const fs::path ckpt = dir_ / "ckpt";
  fs::create_directories(ckpt / "model.safetensors.index.json" / "inside");
  EXPECT_THROW(
      mdist::hf::save_checkpoint(ckpt, {{"a", at::ones({100})}, {"b", at::ones({100})}}, 500),
      SafetensorsError);
  for (const auto& name : dir_entries(ckpt)) {
    EXPECT_EQ(name.find(".tmp."), std::string::npos) << name;
  }
}

TEST_F(SafetensorsTest, ReadsFileWrittenByOfficialLibrary) {
  const fs::path path = fs::path(MDIST_HF_FIXTURES) / "hf_official.safetensors";
  SafetensorsFile file(path);
  EXPECT_EQ(file.metadata().at("source"), "mdist fixture");
  EXPECT_EQ(file.names().size(), 12u);
  expect_same_bits(file.tensor("f32"), at::arange(24, at::kFloat).reshape({2, 3, 4}) * 0.5);
  expect_same_bits(file.tensor("f16"), at::arange(6, at::kHalf).reshape({3, 2}) - 2);
  expect_same_bits(file.tensor("bf16"), at::arange(5, at::kBFloat16) * 0.25);
  expect_same_bits(file.tensor("f64"), at::arange(4, at::kDouble) / 3);
  expect_same_bits(file.tensor("i64"), at::arange(-3, 4, at::kLong));
  expect_same_bits(file.tensor("i32"), at::arange(10, at::kInt).reshape({5, 2}));
  expect_same_bits(file.tensor("i16"), at::arange(-2, 2, at::kShort));
  expect_same_bits(file.tensor("i8"), at::arange(-4, 4, at::kChar));
  expect_same_bits(file.tensor("u8"), at::arange(250, 256, at::kByte));
  expect_same_bits(file.tensor("bool"), at::arange(5).remainder(2) == 0);
  expect_same_bits(file.tensor("scalar"), at::tensor(7.0f).reshape({}));
  expect_same_bits(file.tensor("empty"), at::zeros({0, 3}, at::kFloat));
  expect_same_bits(file.read_rows("i32", 1, 2), at::arange(2, 6, at::kInt).reshape({2, 2}));
}

// ---- malformed files ---------------------------------------------------------------------

TEST_F(SafetensorsTest, RejectsTruncatedFiles) {
  const fs::path tiny = dir_ / "tiny.safetensors";
  write_text(tiny, "abc");
  expect_open_error(tiny, "is 3 bytes, shorter than the 8-byte header length");
  expect_open_error(raw_file("{}", "", 100), "header length 100 goes beyond the end of the file");
  expect_open_error(raw_file("{}", "", 1ull << 62), "exceeds the limit");
  expect_open_error(dir_ / "missing.safetensors", "cannot open");
}

TEST_F(SafetensorsTest, RejectsBadJson) {
  expect_header_error("{\"a\": ", "", "header is not valid JSON");
  expect_header_error("{} trailing", "", "header is not valid JSON");
  expect_header_error("{\"\xff\": 1}", "", "header is not valid JSON");
  expect_header_error("[1, 2]", "", "header is not a JSON object");
  expect_header_error("\"x\"", "", "header is not a JSON object");
}

TEST_F(SafetensorsTest, AcceptsSpacePaddedHeader) {
  SafetensorsFile file(raw_file(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})"
                                "        ",
                                "xy"));
  EXPECT_EQ(file.tensor("a")[1].item<std::uint8_t>(), 'y');
}

TEST_F(SafetensorsTest, RejectsBadEntries) {
  expect_header_error(R"({"a": 1})", "", "tensor \"a\" is not an object");
  expect_header_error(R"({"a":{"shape":[],"data_offsets":[0,4]}})", "1234", "has no \"dtype\"");
  expect_header_error(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", "1234", "has no \"shape\"");
  expect_header_error(R"({"a":{"dtype":"F32","shape":[]}})", "1234", "has no \"data_offsets\"");
  expect_header_error(R"({"a":{"dtype":7,"shape":[],"data_offsets":[0,4]}})", "1234",
                      "\"dtype\" is not a string");
  expect_header_error(R"({"a":{"dtype":"F128","shape":[],"data_offsets":[0,4]}})", "1234",
                      "has unknown dtype \"F128\"");
  expect_header_error(R"({"a":{"dtype":"F32","shape":"1","data_offsets":[0,4]}})", "1234",
                      "\"shape\" is not an array");
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", "1234",
                      "\"shape\" has a non-integer entry 1.5");
  expect_header_error(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "1234",
                      "has negative dimension -1");
  expect_header_error(
      R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,4]}})", "1234",
      "shape overflows");
  expect_header_error(
      R"({"a":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,4]}})", "1234",
      "shape overflows");
  expect_header_error(
      R"({"a":{"dtype":"F32","shape":[0,4611686018427387904,4],"data_offsets":[0,0]}})", "",
      "shape overflows");
  for (const char* offsets : {"[0]", "[0,4,8]", "[\"0\",\"4\"]", "[-1,4]", "{}"}) {
    expect_header_error(
        std::string(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":)") + offsets + "}}", "1234",
        "\"data_offsets\" is not [begin, end]");
  }
  expect_header_error(R"({"__metadata__": [1]})", "", "\"__metadata__\" is not an object");
  expect_header_error(R"({"__metadata__": {"k": 1}})", "",
                      "\"__metadata__\" value of \"k\" is not a string");
  // Names with control characters stay on one line in messages.
  expect_header_error("{\"a\\nb\": 1}", "", "tensor \"a\\nb\" is not an object");
}

TEST_F(SafetensorsTest, RejectsBadOffsets) {
  expect_header_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "1234",
                      "data_offsets [0, 8) go beyond the 4-byte data buffer");
  expect_header_error(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}})", "1234",
                      "data_offsets [4, 0) has begin > end");
  expect_header_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "1234",
                      "hold 4 bytes, but its shape and dtype need 8");
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                      R"("b":{"dtype":"I16","shape":[2],"data_offsets":[2,6]}})",
                      "12345678", "tensor \"b\" overlaps tensor \"a\"");
  // Empty ranges touch nothing; gaps are allowed.
  SafetensorsFile ok(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                              R"("e":{"dtype":"F32","shape":[0],"data_offsets":[5,5]}})",
                              "12345678"));
  EXPECT_EQ(ok.names(), (std::vector<std::string>{"a", "e"}));
}

TEST_F(SafetensorsTest, RejectsDuplicateNames) {
  expect_header_error(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                      R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                      "ab", "header has a duplicate key \"a\"");
  expect_header_error(R"({"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "ab",
                      "duplicate key \"dtype\"");
}

TEST_F(SafetensorsTest, RejectsUnknownNames) {
  const fs::path path = dir_ / "one.safetensors";
  mdist::hf::save_safetensors(path, {{"a", at::ones({1})}});
  SafetensorsFile file(path);
  try {
    (void)file.tensor("nope");
    ADD_FAILURE();
  } catch (const SafetensorsError& e) {
    EXPECT_THAT(e.what(), HasSubstr("one.safetensors\": has no tensor \"nope\""));
  }
  EXPECT_THROW((void)file.info("nope"), SafetensorsError);
  EXPECT_THROW((void)file.read_rows("nope", 0, 1), SafetensorsError);
  mdist::hf::save_checkpoint(dir_ / "c", {{"a", at::ones({1})}}, 100);
  SafetensorsCheckpoint ckpt(dir_ / "c");
  try {
    (void)ckpt.tensor("nope");
    ADD_FAILURE();
  } catch (const SafetensorsError& e) {
    EXPECT_THAT(e.what(), HasSubstr("has no tensor \"nope\""));
  }
}

TEST_F(SafetensorsTest, RejectsBadIndexes) {
  const auto expect_error = [](const fs::path& dir, const std::string& text) {
    try {
      SafetensorsCheckpoint ckpt(dir);
      ADD_FAILURE() << "no error for " << text;
    } catch (const SafetensorsError& e) {
      EXPECT_THAT(e.what(), HasSubstr(text));
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    }
  };
  const fs::path empty = dir_ / "empty";
  fs::create_directories(empty);
  expect_error(empty, "has no model.safetensors and no model.safetensors.index.json");

  const fs::path dir = dir_ / "idx";
  mdist::hf::save_checkpoint(dir, {{"a", at::ones({8})}, {"b", at::ones({8})}}, 40);
  const fs::path index = dir / "model.safetensors.index.json";
  ASSERT_TRUE(fs::exists(index));
  write_text(index, R"({"weight_map": {"a": "model-00009-of-00009.safetensors"}})");
  expect_error(dir, "names missing shard \"model-00009-of-00009.safetensors\"");
  write_text(index, R"({"weight_map": {"c": "model-00001-of-00002.safetensors"}})");
  expect_error(dir, "tensor \"c\" is not in its shard \"model-00001-of-00002.safetensors\"");
  write_text(index, R"({"weight_map": {"a": "../x.safetensors"}})");
  expect_error(dir, "which is not a plain file name");
  write_text(index, R"({"weight_map": {"a": 3}})");
  expect_error(dir, "weight_map entry \"a\" is not a string");
  write_text(index, R"({"metadata": {}})");
  expect_error(dir, "has no \"weight_map\" object");
  write_text(index, R"({"weight_map": {"a": "x", "a": "y"}})");
  expect_error(dir, "has a duplicate key \"a\"");
  write_text(index, "{not json");
  expect_error(dir, "is not valid JSON");
  // A corrupt shard is reported with the shard's name.
  write_text(index, R"({"weight_map": {"a": "model-00001-of-00002.safetensors"}})");
  write_text(dir / "model-00001-of-00002.safetensors", "xx");
  expect_error(dir, "model-00001-of-00002.safetensors\": is 2 bytes");
}

}  // namespace
