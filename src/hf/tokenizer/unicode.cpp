// UTF-8 decoding with replacement (Unicode's "maximal subpart" practice, as Python and Rust
// apply it) and utf8proc-backed properties and normal forms.
#include "src/hf/tokenizer/unicode.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>
#include <stdexcept>

namespace mdist::hf::tok {
namespace {

// Length of the well-formed sequence at s[i], or 0 with `bad` set to the length of the maximal
// ill-formed subpart (at least 1) to replace by one U+FFFD.
std::size_t sequence_at(std::string_view s, std::size_t i, std::size_t& bad) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  bad = 1;
  if (b0 < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;  // range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (int k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return 0;
    const auto b = static_cast<unsigned char>(s[i + k]);
    const bool ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return 0;
    bad = static_cast<std::size_t>(k) + 1;
  }
  return static_cast<std::size_t>(need) + 1;
}

}  // namespace

bool is_valid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    std::size_t bad;
    const auto n = sequence_at(s, i, bad);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

void append_utf8_lossy(std::string_view s, std::string& out) {
  out.reserve(out.size() + s.size());
  std::size_t i = 0;
  while (i < s.size()) {
    std::size_t bad;
    const auto n = sequence_at(s, i, bad);
    if (n == 0) {
      out.append("\xEF\xBF\xBD");
      i += bad;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
}

std::int32_t next_code_point(std::string_view s, std::size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  const int n = utf8_length(b0);
  std::int32_t cp = n == 1 ? b0 : n == 2 ? (b0 & 0x1F) : n == 3 ? (b0 & 0x0F) : (b0 & 0x07);
  for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += static_cast<std::size_t>(n);
  return cp;
}

void append_code_point(std::int32_t cp, std::string& out) {
  utf8proc_uint8_t buf[4];
  const auto n = utf8proc_encode_char(cp, buf);
  out.append(reinterpret_cast<const char*>(buf), static_cast<std::size_t>(n));
}

bool is_whitespace(std::int32_t cp) {
  // The C0/C1 controls with White_Space have category Cc; utf8proc has no White_Space table.
  if ((cp >= 0x09 && cp <= 0x0D) || cp == 0x85) return true;
  const auto cat = utf8proc_category(cp);
  return cat == UTF8PROC_CATEGORY_ZS || cat == UTF8PROC_CATEGORY_ZL || cat == UTF8PROC_CATEGORY_ZP;
}

bool is_alphanumeric(std::int32_t cp) {
  switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

void normalize_unicode(std::string& s, NormalForm form) {
  // Code points below U+0300 are NFC-stable (the first that can change under composition is
  // the combining grave, U+0300, whose UTF-8 lead byte is 0xCC); NFD and the compatibility forms
  // change Latin-1 letters too, so only ASCII is skipped for them.
  const unsigned char limit = form == NormalForm::kNFC ? 0xCC : 0x80;
  bool unchanged = true;
  for (const char c : s) {
    if (static_cast<unsigned char>(c) >= limit) {
      unchanged = false;
      break;
    }
  }
  if (unchanged) return;
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNFC:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::kNFD:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::kNFKC:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::kNFKD:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* out = nullptr;
  const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                              static_cast<utf8proc_ssize_t>(s.size()), &out,
                              static_cast<utf8proc_option_t>(options));
  if (n < 0) throw std::runtime_error(std::string("utf8proc: ") + utf8proc_errmsg(n));
  const std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(out, &std::free);
  s.assign(reinterpret_cast<const char*>(out), static_cast<std::size_t>(n));
}

}  // namespace mdist::hf::tok
