// mdist::hf::Tokenizer: loading tokenizer.json / tokenizer_config.json and the encode/decode
// pipeline of the Python `tokenizers` library (added tokens -> normalizer -> pre-tokenizer ->
// BPE -> post-processor; decoder chain for decode).
#include <fstream>
#include <sstream>
#include <unordered_set>

#include "src/hf/tokenizer/tokenizer_impl.h"
#include "src/hf/tokenizer/unicode.h"

namespace mdist::hf {
namespace tok {

std::string type_of(const Json& j, const std::string& file, const char* component) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) {
    fail(file, std::string(component) + " has no \"type\": " + j.dump().substr(0, 200));
  }
  return j["type"].get<std::string>();
}

}  // namespace tok

namespace {

using tok::fail;
using tok::Json;

Json read_json(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path.string(), "cannot be opened");
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return Json::parse(ss.str());
  } catch (const Json::exception& e) {
    fail(path.string(), std::string("is not valid JSON: ") + e.what());
  }
}

// A special token of tokenizer_config.json: a string, an AddedToken object or null.
std::optional<std::int32_t> config_token(const Json& config, const char* key,
                                         const Tokenizer& tokenizer, const std::string& file) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  std::string content;
  if (it->is_string()) {
    content = it->get<std::string>();
  } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    content = (*it)["content"].get<std::string>();
  } else {
    fail(file, std::string(key) + " is neither a string nor a token object");
  }
  const auto id = tokenizer.token_to_id(content);
  if (!id) fail(file, std::string(key) + " '" + content + "' is not in the vocabulary");
  return id;
}

}  // namespace

void Tokenizer::Impl::encode_valid(std::string_view text, bool continuation,
                                   std::vector<std::int32_t>& out) const {
  // Pieces keeps 32-bit offsets.
  if (text.size() >= (std::size_t{1} << 31)) {
    throw TokenizerError("mdist::hf::Tokenizer::encode: a text of " + std::to_string(text.size()) +
                         " bytes is over the 2 GiB a single encode takes; encode it in parts "
                         "(StreamEncoder cuts at newlines)");
  }
  std::vector<tok::Segment> raw, normalized_segments;
  tok::Pieces pieces, pre_tokenized;
  std::string segment;
  added->split_raw(text, raw);
  for (const auto& seg : raw) {
    if (seg.id >= 0) {
      out.push_back(seg.id);
      continue;
    }
    const bool segment_start = !(continuation && seg.begin == 0);
    const bool text_start = !continuation && seg.begin == 0;
    segment.assign(text.substr(seg.begin, seg.end - seg.begin));
    if (normalizer) normalizer->normalize(segment, segment_start);
    added->split_normalized(segment, normalized_segments);
    for (const auto& part : normalized_segments) {
      if (part.id >= 0) {
        out.push_back(part.id);
        continue;
      }
      pieces.clear();
      pieces.add(std::string_view(segment).substr(part.begin, part.end - part.begin),
                 part.begin == 0 ? segment_start : true, text_start && part.begin == 0);
      const tok::Pieces* words = &pieces;
      if (pre_tokenizer) {
        pre_tokenizer->pre_tokenize(pieces, pre_tokenized);
        words = &pre_tokenized;
      }
      for (const auto& span : words->spans) model->tokenize(words->view(span), out);
    }
  }
}

Tokenizer Tokenizer::from_file(const std::filesystem::path& tokenizer_json,
                               const std::optional<std::filesystem::path>& config_json) {
  const auto file = tokenizer_json.string();
  const Json j = read_json(tokenizer_json);
  if (!j.is_object()) fail(file, "is not a JSON object");
  auto impl = std::make_unique<Impl>();
  impl->file = file;
  try {
    if (const auto t = j.find("truncation"); t != j.end() && !t->is_null()) {
      fail(file, "truncation is not supported (encode returns whole texts)");
    }
    // Padding to the longest of a batch leaves a single encode as it is; any other padding
    // would change its ids.
    if (const auto p = j.find("padding"); p != j.end() && !p->is_null()) {
      const auto strategy = p->value("strategy", Json());
      const bool batch_longest =
          strategy.is_string() && strategy.get<std::string>() == "BatchLongest";
      const auto multiple = p->value("pad_to_multiple_of", Json());
      if (!batch_longest || !multiple.is_null()) {
        fail(file, "padding " + p->dump() + " is not supported (encode returns one unpadded text)");
      }
    }
    const auto model_json = j.find("model");
    if (model_json == j.end()) fail(file, "has no model");
    const auto model_type = model_json->contains("type") ? tok::type_of(*model_json, file, "model")
                                                         : std::string("BPE");
    if (model_type != "BPE") fail(file, "unsupported model type '" + model_type + "' (only BPE)");
    impl->model = std::make_unique<tok::Bpe>(*model_json, file);
    impl->normalizer = tok::load_normalizer(j.value("normalizer", Json()), file);
    impl->pre_tokenizer = tok::load_pre_tokenizer(j.value("pre_tokenizer", Json()), file);
    impl->post_processor = tok::load_post_processor(j.value("post_processor", Json()), file);
    impl->decoder = tok::load_decoder(j.value("decoder", Json()), file);
    impl->added = std::make_unique<tok::AddedVocabulary>(j.value("added_tokens", Json()),
                                                         impl->normalizer.get(), file);
  } catch (const Json::exception& e) {
    fail(file, std::string("malformed: ") + e.what());
  }
  // get_vocab_size(with_added_tokens=True): the model vocab and the added tokens by content.
  std::int64_t extra = 0;
  std::unordered_set<std::string> seen;
  for (const auto& t : impl->added->tokens()) {
    if (!impl->model->token_to_id(t.content) && seen.insert(t.content).second) ++extra;
  }
  impl->vocab_size = static_cast<std::int64_t>(impl->model->vocab().size()) + extra;
  // Byte-level when a ByteLevel step is in the pre-tokenizer (not the whole file: the vocab can
  // be megabytes).
  const bool byte_level =
      j.value("pre_tokenizer", Json()).dump().find("\"ByteLevel\"") != std::string::npos;
  impl->kind = byte_level                     ? "byte-level BPE"
               : impl->model->byte_fallback() ? "BPE with byte fallback"
                                              : "BPE";
  const bool normalizer_ok = !impl->normalizer || impl->normalizer->cut_after_newline_safe();
  const bool split_ok = impl->pre_tokenizer && impl->pre_tokenizer->splits_after_newline();
  const bool barrier = impl->model->is_merge_barrier("\n") &&
                       impl->model->is_merge_barrier(tok::byte_level_char('\n'));
  bool newline_token = false;
  for (const auto& t : impl->added->tokens())
    newline_token |= t.content.find('\n') != std::string::npos;
  impl->stream_cuts = normalizer_ok && (split_ok || barrier) && !newline_token;

  Tokenizer tokenizer(std::move(impl));
  if (config_json) {
    const auto cfile = config_json->string();
    const Json config = read_json(*config_json);
    if (!config.is_object()) fail(cfile, "is not a JSON object");
    auto& im = *tokenizer.impl_;
    im.bos = config_token(config, "bos_token", tokenizer, cfile);
    im.eos = config_token(config, "eos_token", tokenizer, cfile);
    im.pad = config_token(config, "pad_token", tokenizer, cfile);
    for (const auto& [key, target] : {std::pair{"add_bos_token", &im.add_bos_token},
                                      std::pair{"add_eos_token", &im.add_eos_token}}) {
      const auto it = config.find(key);
      if (it == config.end() || it->is_null()) continue;
      if (!it->is_boolean()) fail(cfile, std::string(key) + " is not a boolean");
      *target = it->get<bool>();
    }
  }
  return tokenizer;
}

Tokenizer Tokenizer::from_directory(const std::filesystem::path& dir) {
  const auto config = dir / "tokenizer_config.json";
  return from_file(dir / "tokenizer.json",
                   std::filesystem::exists(config) ? std::optional(config) : std::nullopt);
}

bool Tokenizer::exists_in(const std::filesystem::path& dir) {
  return std::filesystem::is_regular_file(dir / "tokenizer.json");
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

std::vector<std::int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<std::int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (tok::is_valid_utf8(text)) {
    impl_->encode_valid(text, false, ids);
  } else {
    std::string valid;
    tok::append_utf8_lossy(text, valid);
    impl_->encode_valid(valid, false, ids);
  }
  if (add_special_tokens && impl_->post_processor) impl_->post_processor->process(ids);
  return ids;
}

std::string Tokenizer::decode(std::span<const std::int32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const auto id : ids) {
    if (const auto* added = impl_->added->by_id(id)) {
      if (!(skip_special_tokens && added->special)) tokens.push_back(added->pattern);
    } else if (const auto* token = impl_->model->id_to_token(id)) {
      if (skip_special_tokens) {
        const auto* as_added = impl_->added->by_content(*token);
        if (as_added && as_added->special) continue;
      }
      tokens.push_back(*token);
    }
  }
  if (!impl_->decoder) {
    std::string joined;
    for (std::size_t k = 0; k < tokens.size(); ++k) {
      if (k) joined.push_back(' ');
      joined.append(tokens[k]);
    }
    return joined;
  }
  impl_->decoder->decode_chain(tokens);
  std::string out;
  for (const auto& t : tokens) out.append(t);
  return out;
}

std::int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<std::int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto* added = impl_->added->by_content(token)) return added->id;
  return impl_->model->token_to_id(token);
}

std::optional<std::string> Tokenizer::id_to_token(std::int32_t id) const {
  if (const auto* added = impl_->added->by_id(id)) return added->pattern;
  if (const auto* token = impl_->model->id_to_token(id)) return *token;
  return std::nullopt;
}

std::optional<std::int32_t> Tokenizer::bos_token_id() const { return impl_->bos; }
std::optional<std::int32_t> Tokenizer::eos_token_id() const { return impl_->eos; }
std::optional<std::int32_t> Tokenizer::pad_token_id() const { return impl_->pad; }
std::optional<bool> Tokenizer::add_bos_token() const { return impl_->add_bos_token; }
std::optional<bool> Tokenizer::add_eos_token() const { return impl_->add_eos_token; }

std::string Tokenizer::description() const {
  return impl_->kind + ", " + std::to_string(impl_->model->vocab().size()) + " tokens + " +
         std::to_string(impl_->added->tokens().size()) + " added (" +
         std::filesystem::path(impl_->file).filename().string() + ")";
}

}  // namespace mdist::hf
