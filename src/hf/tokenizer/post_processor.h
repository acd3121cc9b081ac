#pragma once
// Post-processors of tokenizer.json for one sequence: TemplateProcessing (BOS/EOS around $A),
// ByteLevel (offsets only: ids unchanged), RobertaProcessing / BertProcessing (cls ... sep) and
// Sequence.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "src/hf/tokenizer/common.h"

namespace mdist::hf::tok {

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // Adds the special tokens of a single sequence around `ids`.
  virtual void process(std::vector<std::int32_t>& ids) const = 0;
};

std::unique_ptr<PostProcessor> load_post_processor(const Json& j, const std::string& file);

}  // namespace mdist::hf::tok
