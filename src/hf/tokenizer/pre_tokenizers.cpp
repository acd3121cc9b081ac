#include "src/hf/tokenizer/pre_tokenizers.h"

#include <array>
#include <unordered_map>
#include <utility>
#include <vector>

#include "src/hf/tokenizer/pattern.h"
#include "src/hf/tokenizer/unicode.h"

namespace mdist::hf::tok {
namespace {

using Matches = std::vector<std::pair<std::size_t, std::size_t>>;

struct ByteMap {
  std::array<std::string, 256> to_char;
  std::unordered_map<std::int32_t, int> to_byte;
  ByteMap() {
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      const std::int32_t cp = printable ? b : next++;
      append_code_point(cp, to_char[static_cast<std::size_t>(b)]);
      to_byte[cp] = b;
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap map;
  return map;
}

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

Behavior parse_behavior(const Json& j, const std::string& file) {
  const auto name = j.get<std::string>();
  if (name == "Removed") return Behavior::kRemoved;
  if (name == "Isolated") return Behavior::kIsolated;
  if (name == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::kMergedWithNext;
  if (name == "Contiguous") return Behavior::kContiguous;
  fail(file, "Split pre-tokenizer: unsupported behavior '" + name + "'");
}

// A piece split by `matches` (sorted, non-overlapping) as tokenizers' NormalizedString::split
// does: the text alternates gaps and matches, the behavior decides what becomes a piece.
void split_piece(std::string_view text, const Matches& matches, Behavior behavior, bool invert,
                 bool segment_start, bool text_start, Pieces& out) {
  struct Part {
    std::size_t begin, end;
    bool match;
  };
  std::vector<Part> parts;
  parts.reserve(matches.size() * 2 + 1);
  std::size_t last = 0;
  for (const auto& [b, e] : matches) {
    if (b > last) parts.push_back({last, b, invert});
    parts.push_back({b, e, !invert});
    last = e;
  }
  if (last < text.size() || parts.empty()) parts.push_back({last, text.size(), invert});

  std::vector<Part> pieces;  // `match` now means "removed"
  pieces.reserve(parts.size());
  switch (behavior) {
    case Behavior::kIsolated:
      for (const auto& p : parts) pieces.push_back({p.begin, p.end, false});
      break;
    case Behavior::kRemoved:
      pieces = parts;
      break;
    case Behavior::kContiguous: {
      bool previous_match = false;
      for (const auto& p : parts) {
        if (p.match == previous_match && !pieces.empty()) {
          pieces.back().end = p.end;
        } else {
          pieces.push_back({p.begin, p.end, false});
        }
        previous_match = p.match;
      }
      break;
    }
    case Behavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const auto& p : parts) {
        if (p.match && !previous_match && !pieces.empty()) {
          pieces.back().end = p.end;
        } else {
          pieces.push_back({p.begin, p.end, false});
        }
        previous_match = p.match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->match && !previous_match && !pieces.empty()) {
          pieces.back().begin = it->begin;
        } else {
          pieces.push_back({it->begin, it->end, false});
        }
        previous_match = it->match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    }
  }
  bool first = true;
  for (const auto& p : pieces) {
    if (p.match || p.end == p.begin) continue;
    // A piece after the first starts a new piece of the original text.
    out.add(text.substr(p.begin, p.end - p.begin), first ? segment_start : true,
            first ? text_start && p.begin == 0 : false);
    first = false;
  }
}

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevel final : public PreTokenizer {
 public:
  ByteLevel(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space),
        regex_(use_regex ? std::make_unique<Regex>(kGpt2Pattern) : nullptr) {}

  void pre_tokenize(const Pieces& in, Pieces& out) const override {
    out.clear();
    out.buf.reserve(in.buf.size() * 2);
    std::string prefixed;
    Matches matches;
    Pieces split;
    for (const auto& span : in.spans) {
      std::string_view text = in.view(span);
      if (text.empty()) continue;  // tokenizers leaves an empty piece alone (no prefix)
      if (add_prefix_space_ && span.segment_start && (text.empty() || text.front() != ' ')) {
        prefixed.assign(" ");
        prefixed.append(text);
        text = prefixed;
      }
      if (regex_) {
        matches.clear();
        regex_->find_all(text, matches);
        split.clear();
        split_piece(text, matches, Behavior::kIsolated, false, span.segment_start, span.text_start,
                    split);
        for (const auto& piece : split.spans) {
          add_mapped(split.view(piece), piece.segment_start, piece.text_start, out);
        }
      } else if (!text.empty()) {
        add_mapped(text, span.segment_start, span.text_start, out);
      }
    }
  }
  bool splits_after_newline() const override { return regex_ != nullptr; }

 private:
  static void add_mapped(std::string_view text, bool segment_start, bool text_start, Pieces& out) {
    const auto begin = static_cast<std::uint32_t>(out.buf.size());
    const auto& map = byte_map().to_char;
    for (const char c : text) out.buf.append(map[static_cast<unsigned char>(c)]);
    out.spans.push_back(
        {begin, static_cast<std::uint32_t>(out.buf.size()), segment_start, text_start});
  }

  bool add_prefix_space_;
  std::unique_ptr<Regex> regex_;
};

class Split final : public PreTokenizer {
 public:
  Split(const Json& j, const std::string& file)
      : pattern_(j.at("pattern"), file, "Split pre-tokenizer"),
        behavior_(parse_behavior(j.at("behavior"), file)),
        invert_(j.value("invert", false)),
        is_regex_(j.at("pattern").contains("Regex")) {}

  void pre_tokenize(const Pieces& in, Pieces& out) const override {
    out.clear();
    out.buf.reserve(in.buf.size());
    Matches matches;
    for (const auto& span : in.spans) {
      const std::string_view text = in.view(span);
      matches.clear();
      pattern_.find_all(text, matches);
      split_piece(text, matches, behavior_, invert_, span.segment_start, span.text_start, out);
    }
  }
  // The open families' Split regexes isolate newline runs; a literal pattern does not.
  bool splits_after_newline() const override {
    return is_regex_ && !invert_ && behavior_ == Behavior::kIsolated;
  }

 private:
  Pattern pattern_;
  Behavior behavior_;
  bool invert_;
  bool is_regex_;
};

class Metaspace final : public PreTokenizer {
 public:
  Metaspace(std::string replacement, std::string scheme, bool split, const std::string& file)
      : replacement_(std::move(replacement)), split_(split) {
    if (scheme == "always") {
      scheme_ = Scheme::kAlways;
    } else if (scheme == "first") {
      scheme_ = Scheme::kFirst;
    } else if (scheme == "never") {
      scheme_ = Scheme::kNever;
    } else {
      fail(file, "Metaspace pre-tokenizer: unsupported prepend_scheme '" + scheme + "'");
    }
  }

  void pre_tokenize(const Pieces& in, Pieces& out) const override {
    out.clear();
    out.buf.reserve(in.buf.size() * 2);
    std::string text;
    Matches matches;
    for (const auto& span : in.spans) {
      if (span.end == span.begin) continue;
      text.clear();
      const bool prepend = span.segment_start && (scheme_ == Scheme::kAlways ||
                                                  (scheme_ == Scheme::kFirst && span.text_start));
      for (const char c : in.view(span)) {
        if (c == ' ') {
          text.append(replacement_);
        } else {
          text.push_back(c);
        }
      }
      if (prepend && text.compare(0, replacement_.size(), replacement_) != 0)
        text.insert(0, replacement_);
      if (!split_) {
        if (!text.empty()) out.add(text, span.segment_start, span.text_start);
        continue;
      }
      matches.clear();
      std::size_t pos = 0;
      while ((pos = text.find(replacement_, pos)) != std::string::npos) {
        matches.emplace_back(pos, pos + replacement_.size());
        pos += replacement_.size();
      }
      split_piece(text, matches, Behavior::kMergedWithNext, false, span.segment_start,
                  span.text_start, out);
    }
  }
  bool splits_after_newline() const override { return false; }

 private:
  enum class Scheme { kAlways, kFirst, kNever };
  std::string replacement_;
  Scheme scheme_ = Scheme::kAlways;
  bool split_;
};

class Sequence final : public PreTokenizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  void pre_tokenize(const Pieces& in, Pieces& out) const override {
    if (steps_.empty()) {
      out = in;
      return;
    }
    Pieces tmp;
    const Pieces* src = &in;
    for (std::size_t i = 0; i < steps_.size(); ++i) {
      // Alternate the two buffers so that the last step writes `out`.
      Pieces& dst = ((steps_.size() - 1 - i) % 2 == 0) ? out : tmp;
      steps_[i]->pre_tokenize(*src, dst);
      src = &dst;
    }
  }
  bool splits_after_newline() const override {
    for (const auto& step : steps_) {
      if (step->splits_after_newline()) return true;
    }
    return false;
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

}  // namespace

const std::string& byte_level_char(unsigned char byte) { return byte_map().to_char[byte]; }

int byte_level_byte(std::int32_t cp) {
  const auto& m = byte_map().to_byte;
  const auto it = m.find(cp);
  return it == m.end() ? -1 : it->second;
}

std::unique_ptr<PreTokenizer> load_pre_tokenizer(const Json& j, const std::string& file) {
  if (j.is_null()) return nullptr;
  const auto type = type_of(j, file, "pre-tokenizer");
  try {
    if (type == "ByteLevel") {
      return std::make_unique<ByteLevel>(j.value("add_prefix_space", true),
                                         j.value("use_regex", true));
    }
    if (type == "Split") return std::make_unique<Split>(j, file);
    if (type == "Metaspace") {
      std::string scheme = "always";
      if (const auto it = j.find("prepend_scheme"); it != j.end()) {
        scheme = it->get<std::string>();
      } else if (const auto old = j.find("add_prefix_space"); old != j.end() && !old->get<bool>()) {
        scheme = "never";
      }
      return std::make_unique<Metaspace>(j.value("replacement", std::string("\xE2\x96\x81")),
                                         scheme, j.value("split", true), file);
    }
    if (type == "Sequence") {
      std::vector<std::unique_ptr<PreTokenizer>> steps;
      for (const auto& step : j.at("pretokenizers"))
        steps.push_back(load_pre_tokenizer(step, file));
      for (const auto& step : steps) {
        if (!step) fail(file, "pre-tokenizer Sequence holds a null step");
      }
      return std::make_unique<Sequence>(std::move(steps));
    }
  } catch (const Json::exception& e) {
    fail(file, "pre-tokenizer " + type + " is malformed: " + e.what());
  } catch (const std::invalid_argument& e) {
    fail(file, "pre-tokenizer " + type + ": " + e.what());
  }
  fail(file, "unsupported pre-tokenizer type '" + type + "'");
}

}  // namespace mdist::hf::tok
