// Safetensors reading (mmap, validated header) and atomic writing, on the file helpers of
// mdist/io. See mdist/hf/safetensors.h.
#include "mdist/hf/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "mdist/io/atomic_file.h"
#include "mdist/io/mapped_file.h"

namespace mdist::hf {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;  // the official library's limit
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

// A JSON-quoted string, with control characters escaped, so messages stay one line.
std::string quote(const std::string& text) {
  return json(text).dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string errno_text(int error) { return std::strerror(error); }

struct DtypeName {
  c10::ScalarType dtype;
  const char* name;
};
constexpr std::array<DtypeName, 15> kDtypes = {{
    {c10::ScalarType::Double, "F64"},
    {c10::ScalarType::Float, "F32"},
    {c10::ScalarType::Half, "F16"},
    {c10::ScalarType::BFloat16, "BF16"},
    {c10::ScalarType::Long, "I64"},
    {c10::ScalarType::Int, "I32"},
    {c10::ScalarType::Short, "I16"},
    {c10::ScalarType::Char, "I8"},
    {c10::ScalarType::Byte, "U8"},
    {c10::ScalarType::Bool, "BOOL"},
    {c10::ScalarType::UInt16, "U16"},
    {c10::ScalarType::UInt32, "U32"},
    {c10::ScalarType::UInt64, "U64"},
    {c10::ScalarType::Float8_e4m3fn, "F8_E4M3"},
    {c10::ScalarType::Float8_e5m2, "F8_E5M2"},
}};

// Parses JSON, rejecting duplicate keys in any object (nlohmann would keep the last silently).
// Throws std::invalid_argument (duplicates) or json::parse_error.
json parse_strict(const char* begin, const char* end) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  json::parser_callback_t callback = [&keys](int depth, json::parse_event_t event, json& parsed) {
    (void)depth;
    switch (event) {
      case json::parse_event_t::object_start:
        keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && !keys.back().insert(parsed.get<std::string>()).second) {
          throw std::invalid_argument("duplicate key " + quote(parsed.get<std::string>()));
        }
        break;
      default:
        break;
    }
    return true;
  };
  return json::parse(begin, end, callback);
}

// Reads a whole (small) file into a string; throws SafetensorsError.
std::string read_text_file(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw SafetensorsError("mdist: cannot open " + quote(path.string()) + ": " + errno_text(errno));
  }
  std::string text;
  std::array<char, 65536> buffer;
  while (true) {
    const ssize_t got = ::read(fd, buffer.data(), buffer.size());
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int error = errno;
      ::close(fd);
      throw SafetensorsError("mdist: cannot read " + quote(path.string()) + ": " +
                             errno_text(error));
    }
    if (got == 0) break;
    text.append(buffer.data(), static_cast<std::size_t>(got));
  }
  ::close(fd);
  return text;
}

std::size_t element_size(c10::ScalarType dtype) { return c10::elementSize(dtype); }

}  // namespace

std::string dtype_name(c10::ScalarType dtype) {
  for (const auto& entry : kDtypes) {
    if (entry.dtype == dtype) return entry.name;
  }
  throw SafetensorsError(std::string("mdist: dtype ") + c10::toString(dtype) +
                         " has no safetensors equivalent");
}

c10::ScalarType dtype_from_name(const std::string& name) {
  for (const auto& entry : kDtypes) {
    if (name == entry.name) return entry.dtype;
  }
  throw SafetensorsError("mdist: unknown safetensors dtype " + quote(name));
}

// ---------------------------------------------------------------------------------------------
// Reading

namespace {

// Throws the SafetensorsError of a malformed or unreadable file, naming it.
class FileProblem {
 public:
  explicit FileProblem(const fs::path& path) : path_(path) {}
  [[noreturn]] void operator()(const std::string& problem) const {
    throw SafetensorsError("mdist: safetensors file " + quote(path_.string()) + ": " + problem);
  }

 private:
  const fs::path& path_;
};

// Maps the file, which must be a regular file of at least the 8 bytes of the header length.
std::shared_ptr<const io::MappedFile> map_safetensors_file(const fs::path& path,
                                                           const FileProblem& fail) {
  // Checked before opening: opening a FIFO would wait for a writer. A status that cannot be
  // read (no such file, no permission) is left to open to report.
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (fs::exists(status) && !fs::is_regular_file(status)) fail("not a regular file");
  std::shared_ptr<const io::MappedFile> mapping;
  try {
    mapping = std::make_shared<const io::MappedFile>(path);
  } catch (const io::FileError& e) {
    fail("cannot " + e.operation() + ": " + errno_text(e.error_number()));
  }
  if (mapping->size() < 8) {
    fail("is " + std::to_string(mapping->size()) + " bytes, shorter than the 8-byte header length");
  }
  return mapping;
}

// The little-endian header length at the start of the file, checked against the limit and the
// file's size.
std::uint64_t header_length_of(const io::MappedFile& file, const FileProblem& fail) {
  const std::uint8_t* bytes = file.data();
  std::uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | bytes[i];
  if (header_size > kMaxHeaderBytes) {
    fail("header length " + std::to_string(header_size) + " exceeds the limit of " +
         std::to_string(kMaxHeaderBytes) + " bytes");
  }
  const std::uint64_t after_length = file.size() - 8;
  if (header_size > after_length) {
    fail("header length " + std::to_string(header_size) + " goes beyond the end of the file (" +
         std::to_string(after_length) + " bytes after the length)");
  }
  return header_size;
}

// The header's JSON object (no duplicate keys).
json parse_header(const io::MappedFile& file, std::uint64_t header_size, const FileProblem& fail) {
  json header;
  try {
    const auto* text = reinterpret_cast<const char*>(file.data() + 8);
    header = parse_strict(text, text + header_size);
  } catch (const json::exception& e) {
    fail(std::string("header is not valid JSON: ") + e.what());
  } catch (const std::invalid_argument& e) {
    fail(std::string("header has a ") + e.what());
  }
  if (!header.is_object()) fail("header is not a JSON object");
  return header;
}

// The "__metadata__" entry: an object of strings.
std::map<std::string, std::string> metadata_of(const json& entry, const FileProblem& fail) {
  if (!entry.is_object()) fail("\"__metadata__\" is not an object");
  std::map<std::string, std::string> metadata;
  for (const auto& [key, value] : entry.items()) {
    if (!value.is_string()) fail("\"__metadata__\" value of " + quote(key) + " is not a string");
    metadata[key] = value.get<std::string>();
  }
  return metadata;
}

// Reads "shape" into info.shape and returns the tensor's byte size. The byte size, and (so that
// libtorch accepts the shape even with a 0 dimension) the product of the non-zero dimensions
// times the element size, must fit in an int64.
std::uint64_t read_shape(const std::string& what, const json& shape, TensorInfo& info,
                         const FileProblem& fail) {
  if (!shape.is_array()) fail(what + " \"shape\" is not an array");
  std::uint64_t bytes_needed = element_size(info.dtype);
  std::uint64_t nonzero_bytes = bytes_needed;
  for (const auto& dim : shape) {
    if (dim.is_number_unsigned()) {
      const auto value = dim.get<std::uint64_t>();
      if (value != 0 && (__builtin_mul_overflow(nonzero_bytes, value, &nonzero_bytes) ||
                         nonzero_bytes > static_cast<std::uint64_t>(INT64_MAX))) {
        fail(what + " shape overflows");
      }
      bytes_needed *= value;  // cannot overflow: at most nonzero_bytes
      info.shape.push_back(static_cast<std::int64_t>(value));
    } else if (dim.is_number_integer()) {
      fail(what + " has negative dimension " + dim.dump());
    } else {
      fail(what + " \"shape\" has a non-integer entry " + dim.dump());
    }
  }
  return bytes_needed;
}

// Reads "data_offsets" into info.begin and info.end: a range inside the data buffer holding
// exactly the bytes the shape and dtype need.
void read_data_offsets(const std::string& what, const json& offsets, std::uint64_t data_size,
                       std::uint64_t bytes_needed, TensorInfo& info, const FileProblem& fail) {
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    fail(what + " \"data_offsets\" is not [begin, end] with non-negative integers");
  }
  info.begin = offsets[0].get<std::uint64_t>();
  info.end = offsets[1].get<std::uint64_t>();
  const std::string range =
      "[" + std::to_string(info.begin) + ", " + std::to_string(info.end) + ")";
  if (info.begin > info.end) fail(what + " data_offsets " + range + " has begin > end");
  if (info.end > data_size) {
    fail(what + " data_offsets " + range + " go beyond the " + std::to_string(data_size) +
         "-byte data buffer");
  }
  if (info.end - info.begin != bytes_needed) {
    fail(what + " data_offsets " + range + " hold " + std::to_string(info.end - info.begin) +
         " bytes, but its shape and dtype need " + std::to_string(bytes_needed));
  }
}

// One tensor's header entry, validated against the data buffer of `data_size` bytes.
TensorInfo tensor_info_of(const std::string& name, const json& entry, std::uint64_t data_size,
                          const FileProblem& fail) {
  const std::string what = "tensor " + quote(name);
  if (!entry.is_object()) fail(what + " is not an object");
  const auto dtype_it = entry.find("dtype");
  const auto shape_it = entry.find("shape");
  const auto offsets_it = entry.find("data_offsets");
  if (dtype_it == entry.end()) fail(what + " has no \"dtype\"");
  if (shape_it == entry.end()) fail(what + " has no \"shape\"");
  if (offsets_it == entry.end()) fail(what + " has no \"data_offsets\"");
  if (!dtype_it->is_string()) fail(what + " \"dtype\" is not a string");
  TensorInfo info{};
  try {
    info.dtype = dtype_from_name(dtype_it->get<std::string>());
  } catch (const SafetensorsError&) {
    fail(what + " has unknown dtype " + quote(dtype_it->get<std::string>()));
  }
  const std::uint64_t bytes_needed = read_shape(what, *shape_it, info, fail);
  read_data_offsets(what, *offsets_it, data_size, bytes_needed, info, fail);
  return info;
}

// No two non-empty byte ranges may overlap.
void check_no_overlaps(const std::map<std::string, TensorInfo>& tensors, const FileProblem& fail) {
  std::vector<std::pair<const std::string*, const TensorInfo*>> by_offset;
  for (const auto& [name, info] : tensors) {
    if (info.end > info.begin) by_offset.emplace_back(&name, &info);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    if (by_offset[i].second->begin < by_offset[i - 1].second->end) {
      fail("tensor " + quote(*by_offset[i].first) + " overlaps tensor " +
           quote(*by_offset[i - 1].first));
    }
  }
}

}  // namespace

void SafetensorsFile::fail(const std::string& problem) const { FileProblem{path_}(problem); }

SafetensorsFile::SafetensorsFile(const fs::path& path) : path_(path) {
  const FileProblem fail(path_);
  mapping_ = map_safetensors_file(path_, fail);
  const std::uint64_t header_size = header_length_of(*mapping_, fail);
  data_start_ = 8 + header_size;
  const std::uint64_t data_size = mapping_->size() - data_start_;
  const json header = parse_header(*mapping_, header_size, fail);
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      metadata_ = metadata_of(entry, fail);
    } else {
      tensors_.emplace(name, tensor_info_of(name, entry, data_size, fail));
    }
  }
  check_no_overlaps(tensors_, fail);
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& entry : tensors_) names.push_back(entry.first);
  return names;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) fail("has no tensor " + quote(name));
  return it->second;
}

const void* SafetensorsFile::mapping_data() const { return mapping_->data(); }
std::size_t SafetensorsFile::mapping_size() const { return mapping_->size(); }

const std::uint8_t* SafetensorsFile::data_of(const TensorInfo& info) const {
  return mapping_->data() + data_start_ + info.begin;
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const TensorInfo& meta = info(name);
  const auto options = at::TensorOptions().dtype(meta.dtype).device(at::kCPU);
  const std::uint8_t* source = data_of(meta);
  const std::size_t bytes = meta.end - meta.begin;
  if (bytes == 0) return at::empty(meta.shape, options);
  if (reinterpret_cast<std::uintptr_t>(source) % element_size(meta.dtype) == 0) {
    std::shared_ptr<const io::MappedFile> keep = mapping_;
    return at::from_blob(
        const_cast<std::uint8_t*>(source), meta.shape, [keep](void*) mutable { keep.reset(); },
        options);
  }
  at::Tensor copy = at::empty(meta.shape, options);
  std::memcpy(copy.data_ptr(), source, bytes);
  return copy;
}

at::Tensor SafetensorsFile::read_rows(const std::string& name, std::int64_t first_row,
                                      std::int64_t rows) const {
  const TensorInfo& meta = info(name);
  if (meta.shape.empty()) fail("read_rows of tensor " + quote(name) + ", which is 0-d");
  const std::int64_t total = meta.shape[0];
  if (first_row < 0 || rows < 0 || first_row > total || rows > total - first_row) {
    fail("read_rows of tensor " + quote(name) + ": rows [" + std::to_string(first_row) + ", " +
         std::to_string(first_row) + "+" + std::to_string(rows) + ") are outside its " +
         std::to_string(total) + " rows");
  }
  std::vector<std::int64_t> shape = meta.shape;
  shape[0] = rows;
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(meta.dtype).device(at::kCPU));
  const std::size_t row_bytes =
      total == 0
          ? 0
          : static_cast<std::size_t>((meta.end - meta.begin) / static_cast<std::uint64_t>(total));
  const std::size_t bytes = row_bytes * static_cast<std::size_t>(rows);
  if (bytes > 0) {
    std::memcpy(out.data_ptr(), data_of(meta) + row_bytes * static_cast<std::size_t>(first_row),
                bytes);
  }
  return out;
}

void SafetensorsFile::release_pages(const std::string& name) const {
  const TensorInfo& meta = info(name);
  // Whole pages, even those shared with a neighbouring tensor: dropping a page only means
  // reading it again from the page cache.
  mapping_->release(static_cast<std::size_t>(data_start_ + meta.begin),
                    static_cast<std::size_t>(meta.end - meta.begin));
}

// ---------------------------------------------------------------------------------------------
// Checkpoints

SafetensorsCheckpoint::SafetensorsCheckpoint(const fs::path& dir) : dir_(dir) {
  const fs::path single = dir / kSingleFile;
  const fs::path index_path = dir / kIndexFile;
  std::error_code ec;
  if (fs::exists(single, ec)) {
    files_.push_back(std::make_unique<SafetensorsFile>(single));
    for (const auto& name : files_[0]->names()) owner_.emplace(name, 0);
    return;
  }
  if (!fs::exists(index_path, ec)) {
    throw SafetensorsError("mdist: safetensors checkpoint " + quote(dir.string()) + " has no " +
                           kSingleFile + " and no " + kIndexFile);
  }
  const auto fail = [&](const std::string& problem) {
    throw SafetensorsError("mdist: safetensors index " + quote(index_path.string()) + ": " +
                           problem);
  };
  const std::string text = read_text_file(index_path);
  json index;
  try {
    index = parse_strict(text.data(), text.data() + text.size());
  } catch (const json::exception& e) {
    fail(std::string("is not valid JSON: ") + e.what());
  } catch (const std::invalid_argument& e) {
    fail(std::string("has a ") + e.what());
  }
  if (!index.is_object()) fail("is not a JSON object");
  const auto map_it = index.find("weight_map");
  if (map_it == index.end() || !map_it->is_object()) fail("has no \"weight_map\" object");
  std::map<std::string, std::size_t> file_index;
  for (const auto& [name, shard_value] : map_it->items()) {
    if (!shard_value.is_string()) fail("weight_map entry " + quote(name) + " is not a string");
    const auto shard = shard_value.get<std::string>();
    if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos ||
        shard.find('\0') != std::string::npos) {
      fail("weight_map entry " + quote(name) + " names " + quote(shard) +
           ", which is not a plain file name");
    }
    auto it = file_index.find(shard);
    if (it == file_index.end()) {
      const fs::path shard_path = dir / shard;
      if (!fs::exists(shard_path, ec)) {
        fail("weight_map entry " + quote(name) + " names missing shard " + quote(shard));
      }
      files_.push_back(std::make_unique<SafetensorsFile>(shard_path));
      it = file_index.emplace(shard, files_.size() - 1).first;
    }
    if (!files_[it->second]->contains(name)) {
      fail("tensor " + quote(name) + " is not in its shard " + quote(shard));
    }
    owner_.emplace(name, it->second);
  }
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> names;
  names.reserve(owner_.size());
  for (const auto& entry : owner_) names.push_back(entry.first);
  return names;
}

const SafetensorsFile& SafetensorsCheckpoint::file_of(const std::string& name) const {
  const auto it = owner_.find(name);
  if (it == owner_.end()) {
    throw SafetensorsError("mdist: safetensors checkpoint " + quote(dir_.string()) +
                           " has no tensor " + quote(name));
  }
  return *files_[it->second];
}

const TensorInfo& SafetensorsCheckpoint::info(const std::string& name) const {
  return file_of(name).info(name);
}

at::Tensor SafetensorsCheckpoint::tensor(const std::string& name) const {
  return file_of(name).tensor(name);
}

at::Tensor SafetensorsCheckpoint::read_rows(const std::string& name, std::int64_t first_row,
                                            std::int64_t rows) const {
  return file_of(name).read_rows(name, first_row, rows);
}

// ---------------------------------------------------------------------------------------------
// Writing

namespace {

// The file helpers' failures as this module's error, with the same message ("mdist: cannot
// rename ..."), for callers that catch SafetensorsError.
template <typename Write>
void with_safetensors_errors(const Write& write) {
  try {
    write();
  } catch (const io::FileError& e) {
    throw SafetensorsError(e.what());
  }
}

}  // namespace

void write_file_atomically(const fs::path& path, std::string_view contents) {
  with_safetensors_errors([&] { io::write_file_atomically(path, contents); });
}

namespace {

// Tensors prepared for writing: contiguous CPU copies in file order.
struct Prepared {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::uint64_t bytes = 0;
};

at::Tensor prepare_tensor(const fs::path& path, const std::string& name, const at::Tensor& t) {
  const auto fail = [&](const std::string& problem) {
    throw SafetensorsError("mdist: cannot write " + quote(path.string()) + ": tensor " +
                           quote(name) + " " + problem);
  };
  if (name == "__metadata__") fail("has the reserved name");
  if (!t.defined()) fail("is undefined");
  if (t.is_sparse() || t.layout() != at::kStrided) fail("is not a dense strided tensor");
  try {
    (void)dtype_name(t.scalar_type());
  } catch (const SafetensorsError&) {
    fail(std::string("has dtype ") + c10::toString(t.scalar_type()) +
         ", which safetensors cannot store");
  }
  return t.detach().to(at::kCPU).contiguous();
}

// Writes one file of `tensors` (already prepared) under a temporary name; returns it finished
// (fsynced), not yet committed.
std::unique_ptr<io::AtomicFile> write_file(const fs::path& path,
                                           std::vector<std::pair<std::string, at::Tensor>> tensors,
                                           const std::map<std::string, std::string>& metadata) {
  std::stable_sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) {
    const auto sa = a.second.element_size();
    const auto sb = b.second.element_size();
    if (sa != sb) return sa > sb;
    return a.first < b.first;
  });
  json header = json::object();
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const auto bytes = static_cast<std::uint64_t>(t.nbytes());
    header[name] = {{"dtype", dtype_name(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump(-1, ' ', false, json::error_handler_t::strict);
  } catch (const json::exception&) {
    throw SafetensorsError("mdist: cannot write " + quote(path.string()) +
                           ": a tensor name or metadata string is not valid UTF-8");
  }
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  std::array<std::uint8_t, 8> length{};
  for (std::size_t i = 0; i < 8; ++i) length[i] = static_cast<std::uint8_t>(text.size() >> (8 * i));

  auto file = std::make_unique<io::AtomicFile>(path);
  file->write(length.data(), length.size());
  file->write(text.data(), text.size());
  for (const auto& [name, t] : tensors) file->write(t.data_ptr(), t.nbytes());
  file->finish();
  return file;
}

}  // namespace

void save_safetensors(const fs::path& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<std::pair<std::string, at::Tensor>> prepared;
  for (const auto& [name, t] : tensors) prepared.emplace_back(name, prepare_tensor(path, name, t));
  with_safetensors_errors([&] { write_file(path, std::move(prepared), metadata)->commit(); });
}

namespace {

// The shards of a sharded checkpoint and their index, all written and fsynced under temporary
// names before any is renamed, the index last: a crash leaves either the old checkpoint's index
// or the new one, whose shards are all in place.
void write_sharded(const fs::path& dir,
                   std::vector<std::vector<std::pair<std::string, at::Tensor>>> shards,
                   std::uint64_t total, const std::map<std::string, std::string>& metadata) {
  const std::size_t count = shards.size();
  const auto shard_name = [count](std::size_t i) {
    char buffer[64];
    std::snprintf(buffer, sizeof(buffer), "model-%05zu-of-%05zu.safetensors", i + 1, count);
    return std::string(buffer);
  };
  std::vector<std::unique_ptr<io::AtomicFile>> files;
  json weight_map = json::object();
  for (std::size_t i = 0; i < count; ++i) {
    for (const auto& entry : shards[i]) weight_map[entry.first] = shard_name(i);
    files.push_back(write_file(dir / shard_name(i), std::move(shards[i]), metadata));
  }
  const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  io::AtomicFile index_file(dir / kIndexFile);
  index_file.write(index.dump(2, ' ', false, json::error_handler_t::strict) + "\n");
  index_file.finish();

  for (auto& file : files) file->commit();
  index_file.commit();
}

}  // namespace

void save_checkpoint(const fs::path& dir, const std::map<std::string, at::Tensor>& tensors,
                     std::uint64_t max_shard_bytes) {
  if (max_shard_bytes == 0) {
    throw SafetensorsError("mdist: save_checkpoint to " + quote(dir.string()) +
                           ": max_shard_bytes is 0");
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    throw SafetensorsError("mdist: cannot create checkpoint directory " + quote(dir.string()) +
                           ": " + ec.message());
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> shards(1);
  std::uint64_t shard_bytes = 0;
  std::uint64_t total = 0;
  for (const auto& [name, t] : tensors) {
    at::Tensor ready = prepare_tensor(dir / kSingleFile, name, t);
    const auto bytes = static_cast<std::uint64_t>(ready.nbytes());
    if (!shards.back().empty() && shard_bytes + bytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().emplace_back(name, std::move(ready));
    shard_bytes += bytes;
    total += bytes;
  }

  with_safetensors_errors([&] {
    if (shards.size() == 1) {
      write_file(dir / kSingleFile, std::move(shards[0]), metadata)->commit();
      fs::remove(dir / kIndexFile, ec);  // a stale index of an earlier sharded save
    } else {
      write_sharded(dir, std::move(shards), total, metadata);
      fs::remove(dir / kSingleFile, ec);  // a stale single file would shadow the index
    }
    io::sync_directory(dir);  // the removal
  });
}

}  // namespace mdist::hf
