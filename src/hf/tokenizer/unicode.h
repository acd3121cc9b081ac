#pragma once
// UTF-8 helpers over utf8proc: lossy decoding as Python's errors="replace" (and Rust's
// from_utf8_lossy) does it, code point iteration, and the character properties the pipeline
// asks about. No character class is written by hand; the tables are utf8proc's.
#include <cstdint>
#include <string>
#include <string_view>

namespace mdist::hf::tok {

// Whether `s` is well-formed UTF-8.
bool is_valid_utf8(std::string_view s);
// Appends `s` to `out` with each maximal ill-formed subpart replaced by U+FFFD.
void append_utf8_lossy(std::string_view s, std::string& out);

// Length in bytes of the UTF-8 sequence starting with `lead` (valid input).
inline int utf8_length(unsigned char lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}
// Decodes the code point at `s[i]` (valid input) and advances i.
std::int32_t next_code_point(std::string_view s, std::size_t& i);
void append_code_point(std::int32_t cp, std::string& out);

// Rust's char::is_whitespace (Unicode White_Space).
bool is_whitespace(std::int32_t cp);
// Rust's char::is_alphanumeric, from the general category (letters and numbers).
bool is_alphanumeric(std::int32_t cp);

enum class NormalForm { kNFC, kNFD, kNFKC, kNFKD };
// Replaces `s` by its normal form.
void normalize_unicode(std::string& s, NormalForm form);

}  // namespace mdist::hf::tok
