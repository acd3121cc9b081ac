// See mdist/hf/activation_checkpointing.h.
#include "mdist/hf/activation_checkpointing.h"

#include <string>

#include "mdist/error.h"

namespace mdist::hf {

std::vector<std::int64_t> apply_activation_checkpointing(CausalLM& model,
                                                         const ActivationCheckpointing& options) {
  if (options.mode == ActivationCheckpointingMode::kSelective && options.every < 1) {
    throw Error("mdist::hf::apply_activation_checkpointing: every must be at least 1, got " +
                std::to_string(options.every));
  }
  auto& layers = model->model->checkpointed_layers;
  const auto count = static_cast<std::int64_t>(model->model->decoder_layers.size());
  layers.assign(static_cast<std::size_t>(count), false);
  std::vector<std::int64_t> marked;
  for (std::int64_t i = 0; i < count; ++i) {
    const bool mark =
        options.mode == ActivationCheckpointingMode::kFull ||
        (options.mode == ActivationCheckpointingMode::kSelective && (i + 1) % options.every == 0);
    layers[static_cast<std::size_t>(i)] = mark;
    if (mark) marked.push_back(i);
  }
  return marked;
}

}  // namespace mdist::hf
