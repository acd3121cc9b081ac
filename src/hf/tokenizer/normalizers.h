#pragma once
// Normalizers of tokenizer.json: NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Strip and
// Sequence. Anything else is refused at load time.
#include <memory>
#include <string>

#include "src/hf/tokenizer/common.h"

namespace mdist::hf::tok {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // Normalizes one segment in place. `segment_start` is false for the continuation of a
  // streamed text, where Prepend must not apply again.
  virtual void normalize(std::string& s, bool segment_start) const = 0;
  // Whether normalizing "a\n" and "b" apart gives the normalization of "a\nb" (every step
  // works on characters or literal runs without newlines): StreamEncoder cuts there.
  virtual bool cut_after_newline_safe() const { return true; }
};

// Null JSON gives nullptr (no normalizer).
std::unique_ptr<Normalizer> load_normalizer(const Json& j, const std::string& file);

}  // namespace mdist::hf::tok
