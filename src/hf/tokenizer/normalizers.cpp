#include "src/hf/tokenizer/normalizers.h"

#include <utf8proc.h>

#include <vector>

#include "src/hf/tokenizer/pattern.h"
#include "src/hf/tokenizer/unicode.h"

namespace mdist::hf::tok {
namespace {

class UnicodeNormalizer final : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormalForm form) : form_(form) {}
  void normalize(std::string& s, bool) const override { normalize_unicode(s, form_); }

 private:
  NormalForm form_;
};

class Lowercase final : public Normalizer {
 public:
  void normalize(std::string& s, bool) const override {
    std::string out;
    out.reserve(s.size());
    for (std::size_t i = 0; i < s.size();)
      append_code_point(utf8proc_tolower(next_code_point(s, i)), out);
    s = std::move(out);
  }
};

class Prepend final : public Normalizer {
 public:
  explicit Prepend(std::string prepend) : prepend_(std::move(prepend)) {}
  void normalize(std::string& s, bool segment_start) const override {
    if (segment_start && !s.empty()) s.insert(0, prepend_);
  }

 private:
  std::string prepend_;
};

class Replace final : public Normalizer {
 public:
  Replace(const Json& j, const std::string& file)
      : pattern_(j.at("pattern"), file, "Replace normalizer"),
        content_(j.at("content").get<std::string>()) {}
  void normalize(std::string& s, bool) const override { s = pattern_.replace_all(s, content_); }
  bool cut_after_newline_safe() const override { return pattern_.is_newline_free_literal(); }

 private:
  Pattern pattern_;
  std::string content_;
};

class Strip final : public Normalizer {
 public:
  Strip(bool left, bool right) : left_(left), right_(right) {}
  void normalize(std::string& s, bool) const override {
    std::size_t begin = 0, end = s.size();
    if (left_) {
      while (begin < end) {
        std::size_t i = begin;
        if (!is_whitespace(next_code_point(s, i))) break;
        begin = i;
      }
    }
    if (right_) {
      while (end > begin) {
        std::size_t start = end - 1;
        while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
        std::size_t i = start;
        if (!is_whitespace(next_code_point(s, i))) break;
        end = start;
      }
    }
    s = s.substr(begin, end - begin);
  }
  bool cut_after_newline_safe() const override { return false; }

 private:
  bool left_, right_;
};

class Sequence final : public Normalizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  void normalize(std::string& s, bool segment_start) const override {
    for (const auto& step : steps_) step->normalize(s, segment_start);
  }
  bool cut_after_newline_safe() const override {
    for (const auto& step : steps_) {
      if (!step->cut_after_newline_safe()) return false;
    }
    return true;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

}  // namespace

std::unique_ptr<Normalizer> load_normalizer(const Json& j, const std::string& file) {
  if (j.is_null()) return nullptr;
  const auto type = type_of(j, file, "normalizer");
  try {
    if (type == "NFC") return std::make_unique<UnicodeNormalizer>(NormalForm::kNFC);
    if (type == "NFD") return std::make_unique<UnicodeNormalizer>(NormalForm::kNFD);
    if (type == "NFKC") return std::make_unique<UnicodeNormalizer>(NormalForm::kNFKC);
    if (type == "NFKD") return std::make_unique<UnicodeNormalizer>(NormalForm::kNFKD);
    if (type == "Lowercase") return std::make_unique<Lowercase>();
    if (type == "Prepend") return std::make_unique<Prepend>(j.at("prepend").get<std::string>());
    if (type == "Replace") return std::make_unique<Replace>(j, file);
    if (type == "Strip") {
      return std::make_unique<Strip>(j.value("strip_left", true), j.value("strip_right", true));
    }
    if (type == "Sequence") {
      std::vector<std::unique_ptr<Normalizer>> steps;
      for (const auto& step : j.at("normalizers")) {
        auto loaded = load_normalizer(step, file);
        if (loaded) steps.push_back(std::move(loaded));
      }
      return std::make_unique<Sequence>(std::move(steps));
    }
  } catch (const Json::exception& e) {
    fail(file, "normalizer " + type + " is malformed: " + e.what());
  }
  fail(file, "unsupported normalizer type '" + type + "'");
}

}  // namespace mdist::hf::tok
