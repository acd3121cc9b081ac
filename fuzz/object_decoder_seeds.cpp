// Writes a seed corpus for object_decoder_fuzzer: valid encodings of every type it decodes,
// each prefixed with the byte that selects that type.
//
//   object_decoder_seeds DIR
//
// Seeds are generated rather than only committed so that they follow the wire format when it
// changes; fuzz/corpus/object_decoder/ holds a copy plus any reproducers worth keeping.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "object_decoder_types.h"

namespace {

namespace fs = std::filesystem;
using namespace mdist_fuzz;

class SeedWriter {
 public:
  explicit SeedWriter(fs::path dir) : dir_(std::move(dir)) {}

  template <std::size_t I>
  void write(const std::vector<DecodeType<I>>& values) {
    for (std::size_t n = 0; n < values.size(); ++n) {
      std::vector<std::uint8_t> bytes = mdist::to_bytes(values[n]);
      bytes.insert(bytes.begin(), static_cast<std::uint8_t>(I));
      const fs::path path = dir_ / ("type" + std::to_string(I) + "-" + std::to_string(n));
      std::ofstream out(path, std::ios::binary);
      out.write(reinterpret_cast<const char*>(bytes.data()),
                static_cast<std::streamsize>(bytes.size()));
      if (!out) throw std::runtime_error("cannot write " + path.string());
      total_bytes_ += bytes.size();
      ++files_;
    }
    types_.insert(I);
  }

  bool covers_every_type() const { return types_.size() == kTypeCount; }
  std::size_t files() const { return files_; }
  std::size_t total_bytes() const { return total_bytes_; }

 private:
  fs::path dir_;
  std::set<std::size_t> types_;
  std::size_t files_ = 0;
  std::size_t total_bytes_ = 0;
};

// Small tensors of every dtype the codec carries, a 0-d one and an empty one.
std::vector<at::Tensor> sample_tensors() {
  std::vector<at::Tensor> tensors;
  for (const auto dtype :
       {at::kBool, at::kByte, at::kChar, at::kShort, at::kInt, at::kLong, at::kUInt16, at::kUInt32,
        at::kUInt64, at::kHalf, at::kBFloat16, at::kFloat, at::kDouble, at::kComplexHalf,
        at::kComplexFloat, at::kComplexDouble, at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
    at::Tensor t = at::empty({2, 2}, at::TensorOptions().dtype(dtype));
    auto* const bytes = static_cast<std::uint8_t*>(t.data_ptr());
    for (std::size_t i = 0; i < t.nbytes(); ++i) {
      bytes[i] = static_cast<std::uint8_t>(dtype == at::kBool ? i % 2 : i * 37 + 1);
    }
    tensors.push_back(t);
  }
  tensors.push_back(at::scalar_tensor(2.5, at::kDouble));
  tensors.push_back(at::empty({0, 3}, at::kFloat));
  return tensors;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const fs::path dir = argv[1];
  fs::create_directories(dir);
  SeedWriter seeds(dir);

  const std::vector<at::Tensor> tensors = sample_tensors();
  seeds.write<0>(tensors);
  seeds.write<1>({{}, {tensors[5], tensors[11]}, {tensors.back(), tensors[0]}});
  seeds.write<2>({{},
                  {{"layer0",
                    {std::nullopt,
                     std::tuple{7, std::vector<float>{1.5f, -2.0f}, std::set<std::string>{"a", "b"},
                                std::pair{true, at::arange(3, at::kInt)},
                                std::list<Phase>{Phase::kTrain, Phase::kEval}}}},
                   {"", {}}}});
  seeds.write<3>(
      {{}, {{"lr", {3e-4}}, {"loss", {2.5, 2.25, std::numeric_limits<double>::quiet_NaN()}}}});
  seeds.write<4>({{-5, 1ULL << 40, 0.5f, -1e300, "name", true, 'c', {}, Phase::kWarmup}});
  seeds.write<5>({std::nullopt, std::pair{std::vector<std::string>{"x", ""}, std::int64_t{-1}}});
  seeds.write<6>({{}, {"alpha", "beta", std::string("nul\0byte", 8)}});
  seeds.write<7>({Stats{1.25, "amax", {1, 2, 3}}, Stats{}});
  seeds.write<8>({{}, {Stats{0.5, "a", {}}, Stats{-0.0, "bb", {4}}}});
  seeds.write<9>({{}, {{1, {1, 2}}, {-7, {}}}});
  seeds.write<10>({{std::nullopt, std::vector<bool>{}, std::vector<bool>{true, false}}});
  seeds.write<11>({{}, {{}, {1}, {2, 3}}});
  seeds.write<12>({"", "hello", std::string(100, 'x')});
  seeds.write<13>({{}, {"u", "v"}});
  seeds.write<14>({{{"a", std::tuple{1, std::vector<float>{2.0f}, "s"}}, {"b", std::nullopt}}});

  if (!seeds.covers_every_type()) {
    std::fprintf(stderr, "object_decoder_seeds: not every decode type has a seed\n");
    return 1;
  }
  std::printf("object_decoder_seeds: %zu seeds, %zu bytes in %s\n", seeds.files(),
              seeds.total_bytes(), dir.c_str());
  return 0;
}
