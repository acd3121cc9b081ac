#include "src/hf/tokenizer/added_vocabulary.h"

#include <algorithm>

#include "src/hf/tokenizer/normalizers.h"
#include "src/hf/tokenizer/unicode.h"

namespace mdist::hf::tok {
namespace {

std::int32_t last_code_point(std::string_view s) {
  std::size_t start = s.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  return next_code_point(s, start);
}

// Offset after the last non-whitespace character of `s` (0 when all whitespace).
std::size_t space_leftmost_at_end(std::string_view s) {
  std::size_t end = s.size();
  while (end > 0) {
    std::size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    std::size_t i = start;
    if (!is_whitespace(next_code_point(s, i))) return end;
    end = start;
  }
  return 0;
}

// Offset of the first non-whitespace character of `s` (s.size() when all whitespace).
std::size_t space_rightmost_at_start(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    std::size_t next = i;
    if (!is_whitespace(next_code_point(s, next))) return i;
    i = next;
  }
  return s.size();
}

}  // namespace

AddedVocabulary::AddedVocabulary(const Json& added_tokens, const Normalizer* normalizer,
                                 const std::string& file) {
  if (added_tokens.is_null()) return;
  if (!added_tokens.is_array()) fail(file, "added_tokens is not an array");
  for (const auto& t : added_tokens) {
    try {
      AddedToken token{t.at("id").get<std::int32_t>(), t.at("content").get<std::string>(),
                       t.value("single_word", false),  t.value("lstrip", false),
                       t.value("rstrip", false),       false,
                       t.value("special", false),      {}};
      token.normalized = t.value("normalized", !token.special);
      if (token.content.empty())
        fail(file, "added token " + std::to_string(token.id) + " is empty");
      by_id_[token.id] = tokens_.size();
      by_content_[token.content] = tokens_.size();
      tokens_.push_back(std::move(token));
    } catch (const Json::exception& e) {
      fail(file, std::string("malformed added token: ") + e.what());
    }
  }
  for (std::size_t k = 0; k < tokens_.size(); ++k) {
    auto& token = tokens_[k];
    token.pattern = token.content;
    // tokenizers matches normalized tokens by their normalized form.
    if (token.normalized && normalizer) normalizer->normalize(token.pattern, true);
    const auto& pattern = token.pattern;
    if (pattern.empty()) continue;
    auto& m = token.normalized ? normalized_ : raw_;
    m.by_first[static_cast<unsigned char>(pattern[0])].emplace_back(pattern, k);
    m.empty = false;
    longest_ = std::max(longest_, pattern.size() + 1);
  }
  for (auto* m : {&raw_, &normalized_}) {
    for (auto& list : m->by_first) {
      std::stable_sort(list.begin(), list.end(), [](const auto& a, const auto& b) {
        return a.first.size() > b.first.size();
      });
    }
  }
}

const AddedToken* AddedVocabulary::by_id(std::int32_t id) const {
  const auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : &tokens_[it->second];
}

const AddedToken* AddedVocabulary::by_content(std::string_view content) const {
  const auto it = by_content_.find(content);
  return it == by_content_.end() ? nullptr : &tokens_[it->second];
}

bool AddedVocabulary::touches(std::string_view text, std::size_t pos) const {
  if (tokens_.empty()) return false;
  const std::size_t from = pos > longest_ ? pos - longest_ : 0;
  for (std::size_t i = from; i <= pos && i < text.size(); ++i) {
    for (const auto* m : {&raw_, &normalized_}) {
      for (const auto& [pattern, k] : m->by_first[static_cast<unsigned char>(text[i])]) {
        // A match that reaches `pos` (or would if the text went on) spans the cut.
        const auto avail = text.substr(i, pattern.size());
        if (pattern.compare(0, avail.size(), avail) == 0 && i + pattern.size() >= pos) return true;
      }
    }
  }
  return false;
}

void AddedVocabulary::split(const Matcher& m, std::string_view text,
                            std::vector<Segment>& out) const {
  out.clear();
  if (m.empty || text.empty()) {
    out.push_back({0, text.size(), -1});
    return;
  }
  std::size_t start_offset = 0;
  std::size_t i = 0;
  while (i < text.size()) {
    const auto& candidates = m.by_first[static_cast<unsigned char>(text[i])];
    const std::pair<std::string, std::size_t>* found = nullptr;
    for (const auto& c : candidates) {
      if (text.compare(i, c.first.size(), c.first) == 0) {
        found = &c;
        break;
      }
    }
    if (!found) {
      ++i;
      continue;
    }
    std::size_t start = i, stop = i + found->first.size();
    i = stop;  // non-overlapping, as the leftmost-longest automaton yields them
    const auto& token = tokens_[found->second];
    if (token.single_word) {
      const bool start_space =
          start == 0 || !is_alphanumeric(last_code_point(text.substr(0, start)));
      std::size_t after = stop;
      const bool stop_space = stop == text.size() || !is_alphanumeric(next_code_point(text, after));
      if (!start_space || !stop_space) continue;
    }
    if (token.lstrip) start = std::max(space_leftmost_at_end(text.substr(0, start)), start_offset);
    if (token.rstrip) stop += space_rightmost_at_start(text.substr(stop));
    if (start_offset < start) out.push_back({start_offset, start, -1});
    out.push_back({start, stop, token.id});
    start_offset = stop;
  }
  if (start_offset < text.size()) out.push_back({start_offset, text.size(), -1});
}

}  // namespace mdist::hf::tok
