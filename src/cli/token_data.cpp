#include "src/cli/token_data.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <numeric>
#include <random>

#include "src/cli/documents.h"
#include "src/cli/input_error.h"

namespace mdist::cli {
namespace {

// Ids checked (and pages released) per step of the range check: bounded memory, few syscalls.
constexpr std::int64_t kCheckChunk = std::int64_t{1} << 20;

static_assert(std::endian::native == std::endian::little, "token files are little-endian");

std::int64_t decode_id(const unsigned char* p, int width, bool is_signed) {
  switch (width) {
    case 1:
      return *p;
    case 2: {
      std::uint16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    default: {
      if (is_signed) {
        std::int32_t v;
        std::memcpy(&v, p, 4);
        return v;
      }
      std::uint32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
  }
}

[[noreturn]] void bad_id(const std::string& name, std::int64_t position, std::int64_t id,
                         std::int64_t vocab_size) {
  throw InputError("data file '" + name + "': token " + std::to_string(position) + " has id " +
                   std::to_string(id) + ", outside the model's vocabulary [0, " +
                   std::to_string(vocab_size) + ")");
}

std::vector<std::int32_t> decimal_ids(std::string_view text, const std::string& name) {
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
      throw InputError("data file '" + name + "': token " + std::to_string(tokens.size()) +
                       " is '" + word.substr(0, 32) + "', not a non-negative integer id");
    }
    tokens.push_back(static_cast<std::int32_t>(value));
    pos = end;
  }
  return tokens;
}

// Bytes of a binary format, in memory, as ids.
std::vector<std::int32_t> binary_ids(std::string_view bytes, int width, bool is_signed,
                                     const std::string& name, DataFormat format,
                                     std::int64_t vocab_size) {
  if (bytes.size() % static_cast<std::size_t>(width) != 0) {
    throw InputError("data file '" + name + "' (" + to_string(format) + ") has " +
                     std::to_string(bytes.size()) + " bytes, not a multiple of " +
                     std::to_string(width));
  }
  std::vector<std::int32_t> ids(bytes.size() / static_cast<std::size_t>(width));
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int64_t id = decode_id(p + i * static_cast<std::size_t>(width), width, is_signed);
    // A u32 id above 2^31 - 1 is outside every vocabulary (and int32): reported here, with the
    // file's value.
    if (id > INT32_MAX) bad_id(name, static_cast<std::int64_t>(i), id, vocab_size);
    ids[i] = static_cast<std::int32_t>(id);
  }
  return ids;
}

int width_of(DataFormat format) {
  switch (format) {
    case DataFormat::u16:
      return 2;
    case DataFormat::u32:
    case DataFormat::i32:
      return 4;
    default:
      return 1;
  }
}

// The [first, count) of `total` tokens `split` selects. 90 % / 10 %, as the shipped corpus is
// used: the tail is text the model never trained on.
std::pair<std::int64_t, std::int64_t> split_range(std::int64_t total, DataSplit split) {
  const std::int64_t cut = total * 9 / 10;
  if (split == DataSplit::train) return {0, cut};
  if (split == DataSplit::eval) return {cut, total - cut};
  return {0, total};
}

std::string describe(const std::string& name, const std::string& format, DataSplit split,
                     std::int64_t count) {
  return name + " (" + format + ", " + to_string(split) + " split: " + std::to_string(count) +
         " tokens)";
}

}  // namespace

DataFormat parse_data_format(const std::string& name) {
  if (name == "auto") return DataFormat::automatic;
  if (name == "text") return DataFormat::text;
  if (name == "ids") return DataFormat::ids;
  if (name == "u16") return DataFormat::u16;
  if (name == "u32") return DataFormat::u32;
  if (name == "i32") return DataFormat::i32;
  throw InputError("unknown data format '" + name +
                   "' (expected auto, text, ids, u16, u32 or i32)");
}

DataFormat resolve_data_format(const std::filesystem::path& path, DataFormat format) {
  if (format != DataFormat::automatic) return format;
  const auto ext = path.extension().string();
  if (ext == ".ids") return DataFormat::ids;
  if (ext == ".u16" || ext == ".bin") return DataFormat::u16;
  if (ext == ".u32") return DataFormat::u32;
  if (ext == ".i32") return DataFormat::i32;
  return DataFormat::text;
}

const char* to_string(DataFormat format) {
  switch (format) {
    case DataFormat::text:
      return "text";
    case DataFormat::ids:
      return "ids";
    case DataFormat::u16:
      return "u16";
    case DataFormat::u32:
      return "u32";
    case DataFormat::i32:
      return "i32";
    case DataFormat::automatic:
      break;
  }
  return "auto";
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

std::int64_t TokenStream::at(std::int64_t i) const {
  if (ids_) return (*ids_)[static_cast<std::size_t>(i)];
  return decode_id(file_->data() + i * width_, width_, signed_);
}

void TokenStream::copy(std::int64_t first, std::int64_t count, std::int64_t* out) const {
  for (std::int64_t i = 0; i < count; ++i) out[i] = at(first_ + first + i);
  if (file_) {
    file_->release(static_cast<std::size_t>((first_ + first) * width_),
                   static_cast<std::size_t>(count * width_));
  }
}

std::vector<std::int32_t> TokenStream::read(std::int64_t first, std::int64_t count) const {
  std::vector<std::int64_t> wide(static_cast<std::size_t>(count));
  copy(first, count, wide.data());
  return {wide.begin(), wide.end()};
}

TokenStream load_tokens(const std::filesystem::path& path, DataFormat format, DataSplit split,
                        std::int64_t vocab_size, CheckPart part) {
  format = resolve_data_format(path, format);
  std::shared_ptr<const io::MappedFile> file =
      std::make_shared<const MappedFile>(path, "data file");
  if (format == DataFormat::ids) {
    const std::string_view text(reinterpret_cast<const char*>(file->data()), file->size());
    return token_stream_of(decimal_ids(text, path.string()), path.string(), "ids", split,
                           vocab_size);
  }
  const int width = width_of(format);
  if (file->size() % static_cast<std::size_t>(width) != 0) {
    throw InputError("data file '" + path.string() + "' (" + to_string(format) + ") has " +
                     std::to_string(file->size()) + " bytes, not a multiple of " +
                     std::to_string(width));
  }
  TokenStream stream;
  stream.file_ = file;
  stream.width_ = width;
  stream.signed_ = format == DataFormat::i32;
  const auto total = static_cast<std::int64_t>(file->size()) / width;
  // This process's share of the check, in chunks whose pages are released once read. Text
  // (bytes) needs no check when the vocabulary covers every byte.
  if (format != DataFormat::text || vocab_size < 256) {
    const std::int64_t lo = total * part.index / part.count;
    const std::int64_t hi = total * (part.index + 1) / part.count;
    for (std::int64_t begin = lo; begin < hi; begin += kCheckChunk) {
      const std::int64_t end = std::min(hi, begin + kCheckChunk);
      for (std::int64_t i = begin; i < end; ++i) {
        const std::int64_t id = stream.at(i);
        if (id < 0 || id >= vocab_size) bad_id(path.string(), i, id, vocab_size);
      }
      file->release(static_cast<std::size_t>(begin * width),
                    static_cast<std::size_t>((end - begin) * width));
    }
  }
  const auto [first, count] = split_range(total, split);
  stream.first_ = first;
  stream.count_ = count;
  stream.description = describe(path.string(), to_string(format), split, count);
  return stream;
}

TokenStream load_tokens_from_bytes(std::string_view bytes, const std::string& name,
                                   DataFormat format, DataSplit split, std::int64_t vocab_size) {
  if (format == DataFormat::automatic) format = DataFormat::text;
  std::vector<std::int32_t> ids;
  switch (format) {
    case DataFormat::text:
      ids.resize(bytes.size());
      std::transform(bytes.begin(), bytes.end(), ids.begin(), [](char c) {
        return static_cast<std::int32_t>(static_cast<unsigned char>(c));
      });
      break;
    case DataFormat::ids:
      ids = decimal_ids(bytes, name);
      break;
    case DataFormat::u16:
    case DataFormat::u32:
    case DataFormat::i32:
      ids =
          binary_ids(bytes, width_of(format), format == DataFormat::i32, name, format, vocab_size);
      break;
    case DataFormat::automatic:
      break;
  }
  return token_stream_of(std::move(ids), name, to_string(format), split, vocab_size);
}

TokenStream token_stream_of(std::vector<std::int32_t> ids, const std::string& name,
                            const std::string& format_label, DataSplit split,
                            std::int64_t vocab_size) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size) {
      bad_id(name, static_cast<std::int64_t>(i), ids[i], vocab_size);
    }
  }
  TokenStream stream;
  const auto [first, count] = split_range(static_cast<std::int64_t>(ids.size()), split);
  stream.ids_ = std::make_shared<const std::vector<std::int32_t>>(std::move(ids));
  stream.first_ = first;
  stream.count_ = count;
  stream.description = describe(name, format_label, split, count);
  return stream;
}

Windows::Windows(const TokenStream& stream, std::int64_t seq_len, const std::string& what)
    : stream_(&stream), seq_len_(seq_len) {
  if (seq_len < 2) throw InputError("--seq-len must be at least 2, got " + std::to_string(seq_len));
  count_ = stream.size() / seq_len;
  if (count_ == 0) {
    throw InputError(what + ": data " + stream.description + " is shorter than one sequence of " +
                     std::to_string(seq_len) + " tokens (--seq-len)");
  }
}

void Windows::copy(std::int64_t i, std::int64_t* out) const {
  stream_->copy(i * seq_len_, seq_len_, out);
}

WindowOrder::WindowOrder(std::int64_t windows, std::uint64_t seed)
    : windows_(windows), seed_(seed) {
  if (windows <= static_cast<std::int64_t>(UINT32_MAX)) {
    narrow_.resize(static_cast<std::size_t>(windows));
  } else {
    wide_.resize(static_cast<std::size_t>(windows));
  }
}

std::int64_t WindowOrder::window_of(std::int64_t k) {
  const std::int64_t epoch = k / windows_;
  if (epoch != epoch_) shuffle_epoch(epoch);
  const auto at = static_cast<std::size_t>(k % windows_);
  return narrow_.empty() ? wide_[at] : static_cast<std::int64_t>(narrow_[at]);
}

namespace {

// Fisher-Yates with our own index draws: std::shuffle's algorithm is unspecified, and the
// order must not depend on the standard library a rank was built with (bench/train_cli.py
// draws the same order in Python).
template <class T>
void shuffle(std::vector<T>& permutation, std::mt19937_64& rng) {
  std::iota(permutation.begin(), permutation.end(), T{0});
  for (auto i = static_cast<std::int64_t>(permutation.size()) - 1; i > 0; --i) {
    const auto j = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(i + 1));
    std::swap(permutation[static_cast<std::size_t>(i)], permutation[static_cast<std::size_t>(j)]);
  }
}

}  // namespace

void WindowOrder::shuffle_epoch(std::int64_t epoch) {
  std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ULL + static_cast<std::uint64_t>(epoch));
  if (narrow_.empty()) {
    shuffle(wide_, rng);
  } else {
    shuffle(narrow_, rng);
  }
  epoch_ = epoch;
}

}  // namespace mdist::cli
