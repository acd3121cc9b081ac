#pragma once
// Block formats need whole blocks along a Linear's inputs: NVFP4 (dynamic blocks of 16) packs
// two E2M1 codes per byte and one E4M3 scale per block of 16 input channels, and modelopt's
// export asserts that the block size divides in_features
// (`NVFP4QTensor.get_weights_scaling_factor`). Its fake quant would pad the tail of a row with
// zeros, so such a model could be calibrated and evaluated but never exported: mdist refuses it
// before calibrating.
//
//   if (auto problem = mdist::quant::block_size_problem(model, config))
//     throw mdist::InputError("--format nvfp4: " + *problem);
#include <optional>
#include <string>

#include "mdist/hf/causal_lm.h"
#include "mdist/quant/quant_config.h"

namespace mdist::quant {

// The first Linear of `model` (any device, the meta device included) whose weight or input
// quantizer `config` enables in blocks the Linear's in_features is not a multiple of:
// "model.layers.0.mlp.down_proj has in_features 40, which nvfp4 (...) does not divide into
// whole blocks of 16". nullopt when there is none. The sizes are the model's weights' (a split
// model: its shards'). `tensor_parallel` > 1 on an unsplit model checks the shards
// hf::parallelize would give it: the row-parallel o_proj and down_proj hold in_features / T
// input channels each ("... has in_features 8 per tensor-parallel rank (32 / 4) ...").
std::optional<std::string> block_size_problem(hf::CausalLM& model, const QuantConfig& config,
                                              int tensor_parallel = 1);

}  // namespace mdist::quant
