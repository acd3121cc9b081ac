#include "src/hf/tokenizer/pattern.h"

#include <stdexcept>

namespace mdist::hf::tok {

Pattern::Pattern(const Json& j, const std::string& file, const char* component) {
  if (!j.is_object()) fail(file, std::string(component) + ": pattern is not an object");
  if (const auto it = j.find("String"); it != j.end() && it->is_string()) {
    literal_ = it->get<std::string>();
    if (literal_.empty()) fail(file, std::string(component) + ": empty String pattern");
  } else if (const auto re = j.find("Regex"); re != j.end() && re->is_string()) {
    try {
      regex_ = std::make_unique<Regex>(re->get<std::string>());
    } catch (const std::invalid_argument& e) {
      fail(file, std::string(component) + ": " + e.what());
    }
  } else {
    fail(file, std::string(component) + ": pattern needs a String or a Regex");
  }
}

void Pattern::find_all(std::string_view text,
                       std::vector<std::pair<std::size_t, std::size_t>>& out) const {
  if (regex_) {
    regex_->find_all(text, out);
    return;
  }
  std::size_t pos = 0;
  while ((pos = text.find(literal_, pos)) != std::string_view::npos) {
    out.emplace_back(pos, pos + literal_.size());
    pos += literal_.size();
  }
}

std::string Pattern::replace_all(std::string_view text, std::string_view content) const {
  std::vector<std::pair<std::size_t, std::size_t>> matches;
  find_all(text, matches);
  if (matches.empty()) return std::string(text);
  std::string out;
  out.reserve(text.size() + matches.size() * content.size());
  std::size_t last = 0;
  for (const auto& [b, e] : matches) {
    out.append(text.substr(last, b - last));
    out.append(content);
    last = e;
  }
  out.append(text.substr(last));
  return out;
}

}  // namespace mdist::hf::tok
