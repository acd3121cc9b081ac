#pragma once
// Documents to token ids as `mdist tokenize` writes them and tokenized --data reads them: each
// document is encode(text, add_special_tokens = true) followed by the tokenizer's EOS (when it
// has one), so that documents stay apart in the stream the model trains on.
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "mdist/hf/tokenizer.h"

namespace mdist::cli {

class DocumentEncoder {
 public:
  explicit DocumentEncoder(const hf::Tokenizer& tokenizer);
  // The ids of one document, appended to `out`.
  void encode(std::string_view document, std::vector<std::int32_t>& out) const;
  // The same for a document too long to encode at once (a whole file): fed to the tokenizer's
  // StreamEncoder in pieces, ids handed to `sink` as they are final, memory bounded.
  void encode_long(std::string_view document,
                   const std::function<void(std::span<const std::int32_t>)>& sink) const;

 private:
  const hf::Tokenizer* tokenizer_;
  std::optional<std::int32_t> eos_;
  // What add_special_tokens = true puts before and after a single sequence (the
  // post-processor's template), found by encoding a probe both ways; for encode_long.
  std::vector<std::int32_t> prefix_, suffix_;
  bool template_known_ = false;
};

}  // namespace mdist::cli
