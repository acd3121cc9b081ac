#pragma once
// The BPE model of tokenizer.json: vocab, merges (both "a b" strings and [a, b] pairs),
// unk_token / fuse_unk, byte_fallback, continuing_subword_prefix, end_of_word_suffix and
// ignore_merges. Dropout is refused (it makes encoding random).
#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "src/hf/tokenizer/common.h"

namespace mdist::hf::tok {

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept {
    return std::hash<std::string_view>{}(s);
  }
};
using Vocab = std::unordered_map<std::string, std::int32_t, StringHash, std::equal_to<>>;

class Bpe {
 public:
  Bpe(const Json& model, const std::string& file);

  // Appends the ids of one pre-tokenized word.
  void tokenize(std::string_view word, std::vector<std::int32_t>& out) const;

  std::optional<std::int32_t> token_to_id(std::string_view token) const;
  const std::string* id_to_token(std::int32_t id) const;
  const Vocab& vocab() const { return vocab_; }
  bool byte_fallback() const { return byte_fallback_; }
  // Whether the symbol(s) of `ch` (one character) take part in no merge, so that BPE never
  // joins it with a neighbour: a cut after it cannot change the ids.
  bool is_merge_barrier(std::string_view ch) const;

 private:
  struct Merge {
    std::int32_t rank;
    std::int32_t new_id;
  };
  static std::uint64_t pair_key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
           static_cast<std::uint32_t>(b);
  }
  void initial_symbols(std::string_view word, std::vector<std::int32_t>& ids) const;
  void merge(std::vector<std::int32_t>& ids) const;

  Vocab vocab_;
  std::vector<const std::string*> id_to_token_;
  std::unordered_map<std::uint64_t, Merge> merges_;
  std::vector<char> in_merge_;  // per id: appears on either side of some merge
  std::optional<std::int32_t> unk_id_;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::int32_t byte_ids_[256];  // <0xXX> ids, -1 where absent

  // Word -> ids for words shorter than kMaxCachedWord; cleared when it reaches kCacheCapacity.
  static constexpr std::size_t kMaxCachedWord = 256;
  static constexpr std::size_t kCacheCapacity = 10000;
  mutable std::shared_mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<std::int32_t>, StringHash, std::equal_to<>>
      cache_;
};

}  // namespace mdist::hf::tok
