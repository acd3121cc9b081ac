#pragma once
// The {"String": ...} / {"Regex": ...} pattern of Split, Replace (normalizer and decoder).
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "src/hf/tokenizer/common.h"
#include "src/hf/tokenizer/regex.h"

namespace mdist::hf::tok {

class Pattern {
 public:
  Pattern(const Json& j, const std::string& file, const char* component);
  // Non-overlapping matches left to right as byte ranges.
  void find_all(std::string_view text, std::vector<std::pair<std::size_t, std::size_t>>& out) const;
  // Every match replaced by `content`.
  std::string replace_all(std::string_view text, std::string_view content) const;
  bool is_newline_free_literal() const {
    return !regex_ && literal_.find('\n') == std::string::npos;
  }

 private:
  std::string literal_;
  std::unique_ptr<Regex> regex_;
};

}  // namespace mdist::hf::tok
