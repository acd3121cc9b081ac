// quant::block_size_problem: see include/mdist/quant/block_check.h.
#include "mdist/quant/block_check.h"

#include <torch/nn/modules/linear.h>

#include <memory>

namespace mdist::quant {

namespace {

// hf::parallelize's row-parallel Linears in the Llama family: their input channels are split.
bool row_parallel(const std::string& name) {
  return name.ends_with(".o_proj") || name.ends_with(".down_proj");
}

}  // namespace

std::optional<std::string> block_size_problem(hf::CausalLM& model, const QuantConfig& config,
                                              int tensor_parallel) {
  for (const auto& item : model->named_modules("", /*include_self=*/false)) {
    const auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(item.value());
    if (!linear) continue;
    // The weight's last dim: the whole in_features, or this rank's columns of a row-parallel
    // Linear (whose blocks must not straddle two ranks either).
    const int64_t whole = linear->weight.size(-1);
    const bool split = tensor_parallel > 1 && row_parallel(item.key());
    const int64_t in_features = split ? whole / tensor_parallel : whole;
    for (const auto role : {QuantizerRole::input, QuantizerRole::weight}) {
      const std::string suffix =
          role == QuantizerRole::input ? ".input_quantizer" : ".weight_quantizer";
      const ResolvedQuantizer q = config.resolve(item.key() + suffix, "nn.Linear", role);
      if (!q.enabled || q.format.block_kind() == BlockKind::none) continue;
      const int64_t block = q.format.block_size();
      if (in_features % block == 0) continue;
      const std::string size = split ? std::to_string(in_features) + " per tensor-parallel rank (" +
                                           std::to_string(whole) + " / " +
                                           std::to_string(tensor_parallel) + ")"
                                     : std::to_string(in_features);
      return item.key() + " has in_features " + size + ", which " + q.format.str() +
             " does not divide into whole blocks of " + std::to_string(block);
    }
  }
  return std::nullopt;
}

}  // namespace mdist::quant
