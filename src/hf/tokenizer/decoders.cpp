#include "src/hf/tokenizer/decoders.h"

#include "src/hf/tokenizer/pattern.h"
#include "src/hf/tokenizer/pre_tokenizers.h"
#include "src/hf/tokenizer/unicode.h"

namespace mdist::hf::tok {
namespace {

class ByteLevel final : public Decoder {
 public:
  // Every token back to its bytes (a token with a character outside the byte map keeps its
  // UTF-8 bytes), then one lossy UTF-8 decode of the whole.
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string bytes, token_bytes;
    for (const auto& token : tokens) {
      token_bytes.clear();
      bool mapped = true;
      for (std::size_t i = 0; i < token.size();) {
        const int b = byte_level_byte(next_code_point(token, i));
        if (b < 0) {
          mapped = false;
          break;
        }
        token_bytes.push_back(static_cast<char>(b));
      }
      bytes.append(mapped ? token_bytes : token);
    }
    std::string text;
    append_utf8_lossy(bytes, text);
    tokens.assign(1, std::move(text));
  }
};

class Metaspace final : public Decoder {
 public:
  Metaspace(std::string replacement, bool strip_first)
      : replacement_(std::move(replacement)), strip_first_(strip_first) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::size_t k = 0; k < tokens.size(); ++k) {
      std::string out;
      const auto& token = tokens[k];
      std::size_t pos = 0, found;
      while ((found = token.find(replacement_, pos)) != std::string::npos) {
        out.append(token, pos, found - pos);
        // tokenizers drops the replacement characters of the first token (when prepending).
        if (!(k == 0 && strip_first_)) out.push_back(' ');
        pos = found + replacement_.size();
      }
      out.append(token, pos);
      tokens[k] = std::move(out);
    }
  }

 private:
  std::string replacement_;
  bool strip_first_;
};

class ByteFallback final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string pending;
    auto flush = [&] {
      if (pending.empty()) return;
      if (is_valid_utf8(pending)) {
        out.push_back(pending);
      } else {
        for (std::size_t k = 0; k < pending.size(); ++k) out.emplace_back("\xEF\xBF\xBD");
      }
      pending.clear();
    };
    for (auto& token : tokens) {
      int value = -1;
      if (token.size() == 6 && token.starts_with("<0x") && token.back() == '>') {
        value = hex(token[3]) * 16 + hex(token[4]);
        if (hex(token[3]) < 0 || hex(token[4]) < 0) value = -1;
      }
      if (value >= 0) {
        pending.push_back(static_cast<char>(value));
      } else {
        flush();
        out.push_back(std::move(token));
      }
    }
    flush();
    tokens = std::move(out);
  }

 private:
  static int hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  }
};

class Fuse final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const auto& t : tokens) all.append(t);
    tokens.assign(1, std::move(all));
  }
};

class Strip final : public Decoder {
 public:
  Strip(std::string content, std::size_t start, std::size_t stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& token : tokens) {
      std::size_t begin = 0, end = token.size();
      for (std::size_t k = 0;
           k < start_ && token.compare(begin, content_.size(), content_) == 0 && begin < end; ++k) {
        begin += content_.size();
      }
      for (std::size_t k = 0; k < stop_ && end >= begin + content_.size() &&
                              token.compare(end - content_.size(), content_.size(), content_) == 0;
           ++k) {
        end -= content_.size();
      }
      token = token.substr(begin, end - begin);
    }
  }

 private:
  std::string content_;
  std::size_t start_, stop_;
};

class Replace final : public Decoder {
 public:
  Replace(const Json& j, const std::string& file)
      : pattern_(j.at("pattern"), file, "Replace decoder"),
        content_(j.at("content").get<std::string>()) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& token : tokens) token = pattern_.replace_all(token, content_);
  }

 private:
  Pattern pattern_;
  std::string content_;
};

class Sequence final : public Decoder {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& step : steps_) step->decode_chain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

}  // namespace

std::unique_ptr<Decoder> load_decoder(const Json& j, const std::string& file) {
  if (j.is_null()) return nullptr;
  const auto type = type_of(j, file, "decoder");
  try {
    if (type == "ByteLevel") return std::make_unique<ByteLevel>();
    if (type == "Metaspace") {
      std::string scheme = j.value("prepend_scheme", std::string("always"));
      if (!j.contains("prepend_scheme") && !j.value("add_prefix_space", true)) scheme = "never";
      return std::make_unique<Metaspace>(j.value("replacement", std::string("\xE2\x96\x81")),
                                         scheme != "never");
    }
    if (type == "ByteFallback") return std::make_unique<ByteFallback>();
    if (type == "Fuse") return std::make_unique<Fuse>();
    if (type == "Strip") {
      return std::make_unique<Strip>(j.at("content").get<std::string>(),
                                     j.at("start").get<std::size_t>(),
                                     j.at("stop").get<std::size_t>());
    }
    if (type == "Replace") return std::make_unique<Replace>(j, file);
    if (type == "Sequence") {
      std::vector<std::unique_ptr<Decoder>> steps;
      for (const auto& step : j.at("decoders")) {
        auto loaded = load_decoder(step, file);
        if (loaded) steps.push_back(std::move(loaded));
      }
      return std::make_unique<Sequence>(std::move(steps));
    }
  } catch (const Json::exception& e) {
    fail(file, "decoder " + type + " is malformed: " + e.what());
  }
  fail(file, "unsupported decoder type '" + type + "'");
}

}  // namespace mdist::hf::tok
