#pragma once
// Added tokens of tokenizer.json ("added_tokens"): matched in the text before the model runs,
// leftmost-longest, the ones with normalized=false on the raw text and the others on the
// normalized text, with single_word / lstrip / rstrip as tokenizers applies them.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "src/hf/tokenizer/bpe.h"
#include "src/hf/tokenizer/common.h"

namespace mdist::hf::tok {

class Normalizer;

struct AddedToken {
  std::int32_t id;
  std::string content;
  bool single_word, lstrip, rstrip, normalized, special;
  // What it matches and decodes as: the content, normalized when `normalized` is set
  // (tokenizers' id_to_token gives this form too).
  std::string pattern;
};

// A part of a segmented text: a run of plain text or one added token.
struct Segment {
  std::size_t begin, end;
  std::int32_t id;  // -1 for plain text
};

class AddedVocabulary {
 public:
  AddedVocabulary(const Json& added_tokens, const Normalizer* normalizer, const std::string& file);

  // Cuts `text` at the matches of the raw (normalized = false) or the normalized tokens.
  void split_raw(std::string_view text, std::vector<Segment>& out) const { split(raw_, text, out); }
  void split_normalized(std::string_view text, std::vector<Segment>& out) const {
    split(normalized_, text, out);
  }
  bool empty() const { return tokens_.empty(); }
  // Whether any added token could match across or touch position `pos` of `text` (a cut there
  // could change what matches).
  bool touches(std::string_view text, std::size_t pos) const;

  const AddedToken* by_id(std::int32_t id) const;
  const AddedToken* by_content(std::string_view content) const;
  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  struct Matcher {
    // Patterns by first byte, longest first.
    std::array<std::vector<std::pair<std::string, std::size_t>>, 256> by_first;
    bool empty = true;
  };
  void split(const Matcher& m, std::string_view text, std::vector<Segment>& out) const;

  std::vector<AddedToken> tokens_;
  std::unordered_map<std::int32_t, std::size_t> by_id_;
  std::unordered_map<std::string, std::size_t, StringHash, std::equal_to<>> by_content_;
  Matcher raw_, normalized_;
  std::size_t longest_ = 0;
};

}  // namespace mdist::hf::tok
