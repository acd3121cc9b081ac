// PCRE2 wrapper: compiled once per tokenizer component, matched with pcre2_jit_match when the
// JIT is available (a several-fold speed-up on the pre-tokenizer regexes).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "src/hf/tokenizer/regex.h"

#include <pcre2.h>

#include <memory>
#include <stdexcept>

#include "src/hf/tokenizer/unicode.h"

namespace mdist::hf::tok {
namespace {

struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};

// One match block per thread, shared by every pattern: only the first pair of the ovector is
// read, so the size fits all.
pcre2_match_data* thread_match_data() {
  thread_local const std::unique_ptr<pcre2_match_data, MatchDataDeleter> data(
      pcre2_match_data_create(1, nullptr));
  return data.get();
}

// tokenizers compiles its patterns with Oniguruma, whose Unicode \w also takes combining marks
// (Letter, Mark, Decimal_Number, Connector_Punctuation); PCRE2 10.42's UCP \w does not, so \w
// and \W are spelled out with those properties. Everything else means the same in both.
std::string onig_to_pcre2(const std::string& pattern) {
  constexpr const char* kWord = R"(\p{L}\p{M}\p{Nd}\p{Pc})";
  std::string out;
  out.reserve(pattern.size() + 32);
  bool in_class = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char next = pattern[++i];
      if (next == 'w') {
        out += in_class ? std::string(kWord) : "[" + std::string(kWord) + "]";
      } else if (next == 'W' && !in_class) {
        out += "[^" + std::string(kWord) + "]";
      } else {
        out += c;
        out += next;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

}  // namespace

Regex::Regex(const std::string& onig_pattern) {
  const std::string pattern = onig_to_pcre2(onig_pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  auto* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                             PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    throw std::invalid_argument("regex '" + pattern + "' does not compile at offset " +
                                std::to_string(offset) + ": " +
                                reinterpret_cast<const char*>(message));
  }
  code_ = code;
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void Regex::find_all(std::string_view text,
                     std::vector<std::pair<std::size_t, std::size_t>>& out) const {
  auto* code = static_cast<pcre2_code*>(code_);
  auto* data = thread_match_data();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const int rc =
        jit_ ? pcre2_jit_match(code, subject, text.size(), pos, 0, data, nullptr)
             : pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, data, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      throw std::runtime_error(std::string("pcre2 match failed: ") +
                               reinterpret_cast<const char*>(message));
    }
    const auto* ovector = pcre2_get_ovector_pointer(data);
    const std::size_t begin = ovector[0], end = ovector[1];
    if (end == begin) {
      // Skip the empty match and the character it sits before.
      if (begin >= text.size()) return;
      pos = begin + static_cast<std::size_t>(utf8_length(static_cast<unsigned char>(text[begin])));
      continue;
    }
    out.emplace_back(begin, end);
    pos = end;
  }
}

}  // namespace mdist::hf::tok
