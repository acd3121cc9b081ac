#pragma once
// Tokenizer::Impl: the loaded pipeline (added tokens, normalizer, pre-tokenizer, BPE model,
// post-processor, decoder) shared by the facade and the stream encoder.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mdist/hf/tokenizer.h"
#include "src/hf/tokenizer/added_vocabulary.h"
#include "src/hf/tokenizer/bpe.h"
#include "src/hf/tokenizer/decoders.h"
#include "src/hf/tokenizer/normalizers.h"
#include "src/hf/tokenizer/post_processor.h"
#include "src/hf/tokenizer/pre_tokenizers.h"

namespace mdist::hf {

struct Tokenizer::Impl {
  std::string file;
  std::string kind;
  std::unique_ptr<tok::Normalizer> normalizer;
  std::unique_ptr<tok::PreTokenizer> pre_tokenizer;
  std::unique_ptr<tok::Bpe> model;
  std::unique_ptr<tok::PostProcessor> post_processor;
  std::unique_ptr<tok::Decoder> decoder;
  std::unique_ptr<tok::AddedVocabulary> added;
  std::optional<std::int32_t> bos, eos, pad;
  std::optional<bool> add_bos_token, add_eos_token;
  std::int64_t vocab_size = 0;
  // StreamEncoder may cut after a "\n" between two non-whitespace characters (see
  // stream_encoder.cpp); false means it keeps the whole text until finish().
  bool stream_cuts = false;

  // Appends the ids of `text` (valid UTF-8) without post-processing. `continuation`: the text
  // continues a streamed text, so its start is neither the text's start nor a new segment.
  void encode_valid(std::string_view text, bool continuation, std::vector<std::int32_t>& out) const;
};

}  // namespace mdist::hf
