#pragma once
// Training and evaluation data of the `mdist` command: a token stream read from a text file
// (byte-level: one token per byte) or from a file of token ids, cut into non-overlapping
// windows of seq_len tokens, and a seeded, per-epoch shuffled order of those windows that every
// rank computes alike (so ranks agree on the global batch without communicating).
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace mdist::cli {

// auto: by extension (.ids: whitespace-separated decimal ids; .u16 / .bin: little-endian
// uint16; .i32: little-endian int32; anything else: text, one token per byte).
enum class DataFormat { automatic, text, ids, u16, i32 };
DataFormat parse_data_format(const std::string& name);  // throws InputError

// Which part of the stream to use: the whole of it, or the first 90 % (train) / last 10 %
// (eval) of it, cut at a token boundary.
enum class DataSplit { all, train, eval };
DataSplit parse_data_split(const std::string& name);  // throws InputError
const char* to_string(DataSplit split);

struct TokenStream {
  std::vector<std::int32_t> tokens;
  std::string description;  // "data/corpus/macbeth.txt (text, train split: 93084 tokens)"
};

// Reads and checks the data: every id must be in [0, vocab_size). Errors (InputError) name the
// file and, for a bad id, its position and value.
TokenStream load_tokens(const std::filesystem::path& path, DataFormat format, DataSplit split,
                        std::int64_t vocab_size);
// The same for bytes already in memory; `name` stands for the file in messages.
TokenStream load_tokens_from_bytes(std::string_view bytes, const std::string& name,
                                   DataFormat format, DataSplit split, std::int64_t vocab_size);

// Non-overlapping windows [i * seq_len, (i + 1) * seq_len) of a stream.
class Windows {
 public:
  // Throws InputError when the stream is shorter than one window.
  Windows(const TokenStream& stream, std::int64_t seq_len, const std::string& what);
  std::int64_t count() const { return count_; }
  std::int64_t seq_len() const { return seq_len_; }
  // Tokens of window i.
  const std::int32_t* data(std::int64_t i) const;

 private:
  const TokenStream* stream_;
  std::int64_t seq_len_;
  std::int64_t count_;
};

// The training order: a fresh permutation of the windows per epoch, drawn from seed + epoch,
// so that the k-th sequence of the run (k counts across epochs) is a pure function of
// (seed, k). Resuming therefore needs only k.
class WindowOrder {
 public:
  WindowOrder(std::int64_t windows, std::uint64_t seed);
  std::int64_t window_of(std::int64_t k);

 private:
  void shuffle_epoch(std::int64_t epoch);
  std::int64_t windows_;
  std::uint64_t seed_;
  std::int64_t epoch_ = -1;
  std::vector<std::int64_t> permutation_;
};

}  // namespace mdist::cli
