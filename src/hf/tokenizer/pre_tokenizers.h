#pragma once
// Pre-tokenizers of tokenizer.json: ByteLevel (GPT-2's regex and byte-to-character map), Split
// (String or Regex pattern, every delimiter behavior, invert), Metaspace and Sequence.
#include <memory>
#include <string>

#include "src/hf/tokenizer/common.h"

namespace mdist::hf::tok {

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits/rewrites every piece of `in` into `out` (cleared first).
  virtual void pre_tokenize(const Pieces& in, Pieces& out) const = 0;
  // Whether "x\ny" (x, y not whitespace) is always cut between "\n" and "y": then such a
  // position is a safe cut point for StreamEncoder.
  virtual bool splits_after_newline() const = 0;
};

std::unique_ptr<PreTokenizer> load_pre_tokenizer(const Json& j, const std::string& file);

// GPT-2's byte -> code point map (printable bytes map to themselves, the rest to U+0100...).
const std::string& byte_level_char(unsigned char byte);
// The inverse; -1 for a code point outside the map.
int byte_level_byte(std::int32_t cp);

}  // namespace mdist::hf::tok
