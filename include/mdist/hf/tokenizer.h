#pragma once
// Hugging Face tokenizers in C++: tokenizer.json (and tokenizer_config.json) as the Python
// `tokenizers` library reads them, for the open causal-LM families:
//   - byte-level BPE: GPT-2 style (ByteLevel pre-tokenizer with its regex), Llama 3 (Split with
//     its regex + ByteLevel, `ignore_merges`), Qwen2 / Qwen3 (their regex, NFC normalizer);
//   - SentencePiece-style BPE with `byte_fallback`: Llama 2, Mistral 7B, TinyLlama (Metaspace
//     pre-tokenizer, or Prepend + Replace normalizers);
//   - added and special tokens, TemplateProcessing / ByteLevel post-processors and the matching
//     decoders.
// Anything else (Unigram, WordPiece, an unknown normalizer, pre-tokenizer, post-processor or
// decoder, BPE dropout) is a TokenizerError naming the component: never a silent fallback.
//
// encode() gives the ids `tokenizers.Tokenizer.encode(text, add_special_tokens).ids` gives;
// decode() the string `Tokenizer.decode(ids, skip_special_tokens)` gives.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mdist/error.h"

namespace mdist::hf {

// tokenizer.json / tokenizer_config.json is missing, malformed or uses an unsupported
// component; the message names the file and the component.
class TokenizerError : public Error {
 public:
  using Error::Error;
};

class Tokenizer {
 public:
  // tokenizer.json alone; bos/eos/pad and add_bos_token/add_eos_token from `config_json`
  // (tokenizer_config.json) when given.
  static Tokenizer from_file(const std::filesystem::path& tokenizer_json,
                             const std::optional<std::filesystem::path>& config_json = {});
  // DIR/tokenizer.json plus DIR/tokenizer_config.json when present.
  static Tokenizer from_directory(const std::filesystem::path& dir);
  // Whether DIR has a tokenizer.json.
  static bool exists_in(const std::filesystem::path& dir);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // UTF-8 text to ids. Invalid UTF-8 is read as Python's bytes.decode("utf-8",
  // errors="replace") reads it (each maximal invalid subpart becomes U+FFFD), which is how a
  // Python program hands such bytes to `tokenizers`.
  std::vector<std::int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  std::string decode(std::span<const std::int32_t> ids, bool skip_special_tokens = false) const;

  // Incremental encoding of one long text fed in pieces: the concatenation of what feed() and
  // finish() return equals encode(whole text, add_special_tokens = false). Memory stays bounded
  // by the longest stretch of text without a safe cut point (a line, in practice).
  class StreamEncoder {
   public:
    explicit StreamEncoder(const Tokenizer& tokenizer);
    StreamEncoder(StreamEncoder&&) noexcept;
    ~StreamEncoder();
    // Appends the ids of every part of the text seen so far that later text cannot change.
    void feed(std::string_view text, std::vector<std::int32_t>& out);
    // Appends the ids of the rest; the encoder is then empty and may start a new text.
    void finish(std::vector<std::int32_t>& out);

   private:
    struct State;
    std::unique_ptr<State> state_;
  };

  // Size of the vocabulary with the added tokens (get_vocab_size(with_added_tokens=True)).
  std::int64_t vocab_size() const;
  std::optional<std::int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(std::int32_t id) const;

  // From tokenizer_config.json (bos_token / eos_token / pad_token, as a string or an
  // AddedToken object), resolved to ids; empty when not set.
  std::optional<std::int32_t> bos_token_id() const;
  std::optional<std::int32_t> eos_token_id() const;
  std::optional<std::int32_t> pad_token_id() const;
  // add_bos_token / add_eos_token of tokenizer_config.json when set there. encode() does not
  // read them (tokenizers does not either: its post-processor decides), they are for callers
  // that build sequences themselves.
  std::optional<bool> add_bos_token() const;
  std::optional<bool> add_eos_token() const;

  // One line for logs: "byte-level BPE, 151643 tokens + 22 added (tokenizer.json)".
  std::string description() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mdist::hf
