#include "src/cli/token_data.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>

#include "src/cli/input_error.h"

namespace mdist::cli {
namespace {

std::string read_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    throw InputError("data file '" + path.string() + "' does not exist");
  }
  if (std::filesystem::is_directory(path, ec)) {
    throw InputError("data file '" + path.string() + "' is a directory");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw InputError("cannot read data file '" + path.string() + "': " + std::strerror(errno));
  }
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (in.bad()) throw InputError("cannot read data file '" + path.string() + "'");
  return std::move(bytes).str();
}

DataFormat resolve(const std::filesystem::path& path, DataFormat format) {
  if (format != DataFormat::automatic) return format;
  const auto ext = path.extension().string();
  if (ext == ".ids") return DataFormat::ids;
  if (ext == ".u16" || ext == ".bin") return DataFormat::u16;
  if (ext == ".i32") return DataFormat::i32;
  return DataFormat::text;
}

const char* name_of(DataFormat format) {
  switch (format) {
    case DataFormat::text:
      return "text";
    case DataFormat::ids:
      return "ids";
    case DataFormat::u16:
      return "u16";
    case DataFormat::i32:
      return "i32";
    case DataFormat::automatic:
      break;
  }
  return "auto";
}

template <class T>
std::vector<std::int32_t> little_endian(std::string_view bytes, const std::filesystem::path& path,
                                        const char* format) {
  if (bytes.size() % sizeof(T) != 0) {
    throw InputError("data file '" + path.string() + "' (" + format + ") has " +
                     std::to_string(bytes.size()) + " bytes, not a multiple of " +
                     std::to_string(sizeof(T)));
  }
  static_assert(std::endian::native == std::endian::little, "token files are little-endian");
  std::vector<std::int32_t> tokens(bytes.size() / sizeof(T));
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    T value;
    std::memcpy(&value, bytes.data() + i * sizeof(T), sizeof(T));
    tokens[i] = static_cast<std::int32_t>(value);
  }
  return tokens;
}

std::vector<std::int32_t> decimal_ids(std::string_view text, const std::filesystem::path& path) {
  std::vector<std::int32_t> tokens;
  std::size_t pos = 0;
  while (true) {
    pos = text.find_first_not_of(" \t\r\n", pos);
    if (pos == std::string::npos) break;
    const auto end = std::min(text.find_first_of(" \t\r\n", pos), text.size());
    const std::string word(text.substr(pos, end - pos));
    std::int64_t value = 0;
    const bool digits =
        !word.empty() && word.size() <= 10 &&
        std::all_of(word.begin(), word.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (!digits || (value = std::stoll(word)) > INT32_MAX) {
      throw InputError("data file '" + path.string() + "': token " + std::to_string(tokens.size()) +
                       " is '" + word.substr(0, 32) + "', not a non-negative integer id");
    }
    tokens.push_back(static_cast<std::int32_t>(value));
    pos = end;
  }
  return tokens;
}

}  // namespace

DataFormat parse_data_format(const std::string& name) {
  if (name == "auto") return DataFormat::automatic;
  if (name == "text") return DataFormat::text;
  if (name == "ids") return DataFormat::ids;
  if (name == "u16") return DataFormat::u16;
  if (name == "i32") return DataFormat::i32;
  throw InputError("unknown data format '" + name + "' (expected auto, text, ids, u16 or i32)");
}

DataSplit parse_data_split(const std::string& name) {
  if (name == "all") return DataSplit::all;
  if (name == "train") return DataSplit::train;
  if (name == "eval") return DataSplit::eval;
  throw InputError("unknown data split '" + name + "' (expected all, train or eval)");
}

const char* to_string(DataSplit split) {
  switch (split) {
    case DataSplit::train:
      return "train";
    case DataSplit::eval:
      return "eval";
    case DataSplit::all:
      break;
  }
  return "all";
}

TokenStream load_tokens(const std::filesystem::path& path, DataFormat format, DataSplit split,
                        std::int64_t vocab_size) {
  const std::string bytes = read_file(path);
  return load_tokens_from_bytes(bytes, path.string(), resolve(path, format), split, vocab_size);
}

TokenStream load_tokens_from_bytes(std::string_view bytes, const std::string& name,
                                   DataFormat format, DataSplit split, std::int64_t vocab_size) {
  const std::filesystem::path path = name;
  if (format == DataFormat::automatic) format = DataFormat::text;
  std::vector<std::int32_t> tokens;
  switch (format) {
    case DataFormat::text:
      tokens.resize(bytes.size());
      std::transform(bytes.begin(), bytes.end(), tokens.begin(), [](char c) {
        return static_cast<std::int32_t>(static_cast<unsigned char>(c));
      });
      break;
    case DataFormat::ids:
      tokens = decimal_ids(bytes, path);
      break;
    case DataFormat::u16:
      tokens = little_endian<std::uint16_t>(bytes, path, "u16");
      break;
    case DataFormat::i32:
      tokens = little_endian<std::int32_t>(bytes, path, "i32");
      break;
    case DataFormat::automatic:
      break;
  }
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_size) {
      throw InputError("data file '" + path.string() + "': token " + std::to_string(i) +
                       " has id " + std::to_string(tokens[i]) +
                       ", outside the model's vocabulary [0, " + std::to_string(vocab_size) + ")");
    }
  }
  // 90 % / 10 %, as the shipped corpus is used: the tail is text the model never trained on.
  const auto cut = static_cast<std::ptrdiff_t>(tokens.size() * 9 / 10);
  if (split == DataSplit::train) tokens.erase(tokens.begin() + cut, tokens.end());
  if (split == DataSplit::eval) tokens.erase(tokens.begin(), tokens.begin() + cut);
  TokenStream stream;
  stream.description = name + " (" + name_of(format) + ", " + to_string(split) +
                       " split: " + std::to_string(tokens.size()) + " tokens)";
  stream.tokens = std::move(tokens);
  return stream;
}

Windows::Windows(const TokenStream& stream, std::int64_t seq_len, const std::string& what)
    : stream_(&stream), seq_len_(seq_len) {
  if (seq_len < 2) throw InputError("--seq-len must be at least 2, got " + std::to_string(seq_len));
  count_ = static_cast<std::int64_t>(stream.tokens.size()) / seq_len;
  if (count_ == 0) {
    throw InputError(what + ": data " + stream.description + " is shorter than one sequence of " +
                     std::to_string(seq_len) + " tokens (--seq-len)");
  }
}

const std::int32_t* Windows::data(std::int64_t i) const {
  return stream_->tokens.data() + i * seq_len_;
}

WindowOrder::WindowOrder(std::int64_t windows, std::uint64_t seed)
    : windows_(windows), seed_(seed), permutation_(static_cast<std::size_t>(windows)) {}

std::int64_t WindowOrder::window_of(std::int64_t k) {
  const std::int64_t epoch = k / windows_;
  if (epoch != epoch_) shuffle_epoch(epoch);
  return permutation_[static_cast<std::size_t>(k % windows_)];
}

void WindowOrder::shuffle_epoch(std::int64_t epoch) {
  // Fisher-Yates with our own index draws: std::shuffle's algorithm is unspecified, and the
  // order must not depend on the standard library a rank was built with.
  std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ULL + static_cast<std::uint64_t>(epoch));
  std::iota(permutation_.begin(), permutation_.end(), std::int64_t{0});
  for (std::int64_t i = windows_ - 1; i > 0; --i) {
    const auto j = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(i + 1));
    std::swap(permutation_[static_cast<std::size_t>(i)], permutation_[static_cast<std::size_t>(j)]);
  }
  epoch_ = epoch;
}

}  // namespace mdist::cli
