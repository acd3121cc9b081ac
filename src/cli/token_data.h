#pragma once
// Training and evaluation data of the `mdist` command: a token stream read from a text file
// (byte-level: one token per byte, or through the model's tokenizer) or from a file of token
// ids, cut into non-overlapping windows of seq_len tokens, and a seeded, per-epoch shuffled
// order of those windows that every rank computes alike (so ranks agree on the global batch
// without communicating).
//
// Binary token files and byte-level text are memory-mapped, never read whole: a window is read
// from the mapping when its batch is built, and the pages read are handed back to the kernel,
// so that a rank's resident memory does not grow with the data (a 2 GiB file costs what a 1 MiB
// one does). The id range check scans the file in chunks, and can be split across the ranks.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "mdist/io/mapped_file.h"

namespace mdist::cli {

// auto: by extension (.ids: whitespace-separated decimal ids; .u16 / .bin: little-endian
// uint16; .u32: little-endian uint32; .i32: little-endian int32; anything else: text).
enum class DataFormat { automatic, text, ids, u16, u32, i32 };
DataFormat parse_data_format(const std::string& name);  // throws InputError
// `format`, or for automatic the format `path`'s extension names.
DataFormat resolve_data_format(const std::filesystem::path& path, DataFormat format);
const char* to_string(DataFormat format);

// Which part of the stream to use: the whole of it, or the first 90 % (train) / last 10 %
// (eval) of it, cut at a token boundary.
enum class DataSplit { all, train, eval };
DataSplit parse_data_split(const std::string& name);  // throws InputError
const char* to_string(DataSplit split);

// Which share of the id range check this process makes: part `index` of `count` equal parts of
// the file (a job's ranks each take theirs, and agree on the outcome; the lowest rank that
// finds a bad id then names the first one in the file).
struct CheckPart {
  int index = 0;
  int count = 1;
};

// A sequence of token ids: a view of a memory-mapped file, or ids held in memory (the embedded
// corpus, decimal .ids files, tokenized text). Cheap to copy (the storage is shared).
class TokenStream {
 public:
  TokenStream() = default;
  std::int64_t size() const { return count_; }
  // Tokens [first, first + count) as int64 (the model's input dtype) into `out`; pages of a
  // mapped file are released again once read.
  void copy(std::int64_t first, std::int64_t count, std::int64_t* out) const;
  std::vector<std::int32_t> read(std::int64_t first, std::int64_t count) const;

  std::string description;  // "data/corpus/macbeth.txt (text, train split: 93084 tokens)"

 private:
  friend TokenStream load_tokens(const std::filesystem::path&, DataFormat, DataSplit, std::int64_t,
                                 CheckPart);
  friend TokenStream token_stream_of(std::vector<std::int32_t>, const std::string&,
                                     const std::string&, DataSplit, std::int64_t);
  std::int64_t at(std::int64_t i) const;  // the id at position i of the file or vector

  std::shared_ptr<const io::MappedFile> file_;
  int width_ = 0;        // bytes per id in the file: 1 (text), 2, 4
  bool signed_ = false;  // i32
  std::shared_ptr<const std::vector<std::int32_t>> ids_;
  std::int64_t first_ = 0;  // the stream's first token in the file / vector
  std::int64_t count_ = 0;
};

// Reads and checks the data: every id must be in [0, vocab_size). Errors (InputError) name the
// file and, for a bad id, its position and value. Text is read as bytes here (a tokenizer's
// ids come through token_stream_of). `part`: the share of the range check this process makes.
TokenStream load_tokens(const std::filesystem::path& path, DataFormat format, DataSplit split,
                        std::int64_t vocab_size, CheckPart part = {});
// The same for bytes already in memory; `name` stands for the file in messages.
TokenStream load_tokens_from_bytes(std::string_view bytes, const std::string& name,
                                   DataFormat format, DataSplit split, std::int64_t vocab_size);
// Ids already in memory (`format_label` for the description: "text, tokenizer"), checked and
// split the same way.
TokenStream token_stream_of(std::vector<std::int32_t> ids, const std::string& name,
                            const std::string& format_label, DataSplit split,
                            std::int64_t vocab_size);

// Non-overlapping windows [i * seq_len, (i + 1) * seq_len) of a stream.
class Windows {
 public:
  // Throws InputError when the stream is shorter than one window.
  Windows(const TokenStream& stream, std::int64_t seq_len, const std::string& what);
  std::int64_t count() const { return count_; }
  std::int64_t seq_len() const { return seq_len_; }
  // Tokens of window i into out[0, seq_len).
  void copy(std::int64_t i, std::int64_t* out) const;

 private:
  const TokenStream* stream_;
  std::int64_t seq_len_;
  std::int64_t count_;
};

// The training order: a fresh permutation of the windows per epoch, drawn from seed + epoch,
// so that the k-th sequence of the run (k counts across epochs) is a pure function of
// (seed, k). Resuming therefore needs only k. The permutation takes 4 bytes per window (8 only
// beyond 2^32 windows).
class WindowOrder {
 public:
  WindowOrder(std::int64_t windows, std::uint64_t seed);
  std::int64_t window_of(std::int64_t k);

 private:
  void shuffle_epoch(std::int64_t epoch);
  std::int64_t windows_;
  std::uint64_t seed_;
  std::int64_t epoch_ = -1;
  std::vector<std::uint32_t> narrow_;  // used while the window count fits in 32 bits
  std::vector<std::int64_t> wide_;
};

}  // namespace mdist::cli
