// fnmatch-style wildcards (Python's fnmatch.translate: `*`, `?`, sets; a full match).
#include "mdist/quant/wildcard.h"

#include <cstddef>
#include <optional>

namespace mdist::quant {
namespace {

// A set starting at pattern[open] == '['. Its end (one past the closing ']') and whether `c`
// is in it; nullopt when the set is not closed (the '[' is then a literal character).
struct SetMatch {
  std::size_t end;
  bool matched;
};

std::optional<SetMatch> match_set(std::string_view pattern, std::size_t open, char c) {
  std::size_t i = open + 1;
  const bool negated = i < pattern.size() && pattern[i] == '!';
  if (negated) ++i;
  // A ']' right after '[' or '[!' is a member, not the end.
  std::size_t close = i < pattern.size() && pattern[i] == ']' ? i + 1 : i;
  while (close < pattern.size() && pattern[close] != ']') ++close;
  if (close >= pattern.size()) return std::nullopt;
  bool in = false;
  for (std::size_t k = i; k < close; ++k) {
    if (k + 2 < close && pattern[k + 1] == '-') {
      // A range lo-hi; Python drops ranges whose hi is below lo (they match nothing).
      in = in || (pattern[k] <= c && c <= pattern[k + 2]);
      k += 2;
    } else {
      in = in || pattern[k] == c;
    }
  }
  return SetMatch{close + 1, in != negated};
}

}  // namespace

bool wildcard_match(std::string_view pattern, std::string_view name) {
  // Iterative matching with one backtrack point: the last '*' and the name position it was
  // tried at. Linear in practice, correct for any number of stars (a later star supersedes
  // the earlier one's backtracking, since it can absorb whatever the earlier one would have).
  std::size_t p = 0, n = 0;
  std::optional<std::size_t> star_p, star_n;
  while (n < name.size()) {
    if (p < pattern.size()) {
      const char token = pattern[p];
      if (token == '*') {
        star_p = ++p;
        star_n = n;
        continue;
      }
      if (token == '?') {
        ++p;
        ++n;
        continue;
      }
      if (token == '[') {
        if (const auto set = match_set(pattern, p, name[n])) {
          if (set->matched) {
            p = set->end;
            ++n;
            continue;
          }
        } else if (name[n] == '[') {  // an unclosed '[' is literal
          ++p;
          ++n;
          continue;
        }
      } else if (token == name[n]) {
        ++p;
        ++n;
        continue;
      }
    }
    if (!star_p) return false;
    p = *star_p;
    n = ++*star_n;
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace mdist::quant
