#pragma once
// Decoders of tokenizer.json: ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace and
// Sequence, each a step over the list of token strings as tokenizers' decode_chain is.
#include <memory>
#include <string>
#include <vector>

#include "src/hf/tokenizer/common.h"

namespace mdist::hf::tok {

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

std::unique_ptr<Decoder> load_decoder(const Json& j, const std::string& file);

}  // namespace mdist::hf::tok
