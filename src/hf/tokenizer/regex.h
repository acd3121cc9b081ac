#pragma once
// A PCRE2 pattern (UTF + Unicode properties, JIT-compiled where the platform allows) with a
// find-all that reuses one match block per thread.
#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mdist::hf::tok {

class Regex {
 public:
  // Throws std::invalid_argument with PCRE2's message when `pattern` does not compile.
  explicit Regex(const std::string& pattern);
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex();

  // Non-overlapping matches left to right, as [begin, end) byte offsets; `text` must be valid
  // UTF-8. An empty match advances by one character, as Oniguruma's find-all does.
  void find_all(std::string_view text, std::vector<std::pair<std::size_t, std::size_t>>& out) const;

 private:
  void* code_ = nullptr;  // pcre2_code_8*, kept out of the header
  bool jit_ = false;
};

}  // namespace mdist::hf::tok
