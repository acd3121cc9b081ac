// Tokenizer::StreamEncoder: encodes a long text fed in pieces, cutting only where the ids of
// the parts equal the ids of the whole. A cut goes right after a "\n" that has a
// non-whitespace character on both sides, when
//   - no added token could match across it (nor one with lstrip start right after it),
//   - the normalizer works per character or per newline-free literal, and
//   - the pre-tokenizer always splits there (the regexes of the byte-level families put a
//     lone "\n" between non-spaces in a piece of its own), or the newline's BPE symbol takes
//     part in no merge (SentencePiece-style models, where the whole text can be one word).
// The part after a cut is encoded as a continuation: no Prepend, prefix space or Metaspace
// replacement is added at its start. Without a safe cut the text stays buffered to finish().
#include "src/hf/tokenizer/tokenizer_impl.h"
#include "src/hf/tokenizer/unicode.h"

namespace mdist::hf {
namespace {

// The code point that ends at `end` (exclusive) of possibly invalid UTF-8, as the lossy decode
// of the whole text would read it.
std::int32_t code_point_before(std::string_view s, std::size_t end) {
  const std::size_t from = end >= 4 ? end - 4 : 0;
  std::string window;
  tok::append_utf8_lossy(s.substr(from, end - from), window);
  std::size_t start = window.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(window[start]) & 0xC0) == 0x80) --start;
  return tok::next_code_point(window, start);
}

}  // namespace

struct Tokenizer::StreamEncoder::State {
  const Impl* impl;
  std::string buffer;
  std::size_t checked = 1;  // cut candidates before this index were rejected for good
  bool started = false;     // a part has been encoded: the buffer continues a text

  void encode_part(std::string_view part, std::vector<std::int32_t>& out) {
    if (tok::is_valid_utf8(part)) {
      impl->encode_valid(part, started, out);
    } else {
      std::string valid;
      tok::append_utf8_lossy(part, valid);
      impl->encode_valid(valid, started, out);
    }
    started = true;
  }

  // The last safe cut in the buffer (the index after the "\n"), or 0.
  std::size_t find_cut() {
    std::size_t best = 0;
    std::size_t q = buffer.find('\n', checked);
    while (q != std::string::npos) {
      const std::size_t after = q + 1;
      if (after >= buffer.size()) break;
      const auto lead = static_cast<unsigned char>(buffer[after]);
      if (after + static_cast<std::size_t>(tok::utf8_length(lead)) > buffer.size()) break;
      checked = after;
      std::string next;
      tok::append_utf8_lossy(std::string_view(buffer).substr(after, tok::utf8_length(lead)), next);
      std::size_t i = 0;
      const bool ok = !tok::is_whitespace(code_point_before(buffer, q)) &&
                      !tok::is_whitespace(tok::next_code_point(next, i)) &&
                      !impl->added->touches(buffer, after) && !impl->added->touches(buffer, q);
      if (ok) best = after;
      q = buffer.find('\n', after);
    }
    return best;
  }
};

Tokenizer::StreamEncoder::StreamEncoder(const Tokenizer& tokenizer)
    : state_(std::make_unique<State>()) {
  state_->impl = tokenizer.impl_.get();
}
Tokenizer::StreamEncoder::StreamEncoder(StreamEncoder&&) noexcept = default;
Tokenizer::StreamEncoder::~StreamEncoder() = default;

void Tokenizer::StreamEncoder::feed(std::string_view text, std::vector<std::int32_t>& out) {
  auto& s = *state_;
  s.buffer.append(text);
  if (!s.impl->stream_cuts) return;
  const std::size_t cut = s.find_cut();
  if (cut == 0) return;
  s.encode_part(std::string_view(s.buffer).substr(0, cut), out);
  s.buffer.erase(0, cut);
  s.checked = 1;
}

void Tokenizer::StreamEncoder::finish(std::vector<std::int32_t>& out) {
  auto& s = *state_;
  if (!s.buffer.empty()) s.encode_part(s.buffer, out);
  s.buffer.clear();
  s.checked = 1;
  s.started = false;
}

}  // namespace mdist::hf
