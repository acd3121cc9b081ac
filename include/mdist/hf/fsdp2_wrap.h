#pragma once
// Decoder-layer discovery and fsdp2_wrap for Hugging Face style causal LMs: the spec's
// `fsdp2_wrap(model, shard_root=True, mp_policy=None, cpu_offload=False)`.
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <vector>

#include "mdist/fsdp/fully_shard.h"

namespace mdist {

// The decoder layers of a causal LM, found by attribute path as the reference does: from the
// root into `model`, then `language_model`, then `layers`; else the other common layouts
// `transformer.h`, `gpt_neox.layers`, `model.decoder.layers`, `backbone.layers`. Returned only
// when every layer has the same module type; otherwise (or when nothing matches) empty.
// Works on any torch::nn::Module tree with those names.
std::vector<std::shared_ptr<torch::nn::Module>> get_decoder_layers(torch::nn::Module& model);

// Detects the decoder layers and fully_shard's each (reshard_after_forward), then the root
// unless shard_root is false (the root's own parameters, e.g. embeddings and head, then stay
// replicated). Parameters whose dtype differs from the model's dominant dtype (by element
// count) stay whole and replicated, are moved to the compute device, and rank 0 warns once,
// naming up to three of them and their share of the elements. Returns the detected layers.
// A model whose parameters are on the meta device (built without storage) is accepted: shards
// get real shard-sized memory (zeros) and every parameter kept whole is materialised,
// uninitialised, on the compute device (the current GPU if there is one, else the CPU); no
// rank allocates the full model. Fill it with hf::load_checkpoint_sharded (or use
// hf::load_pretrained_fsdp2, which does all of it).
// Throws Error "Could not auto-detect decoder layers; ..." when there are none.
// `group`: the ranks the parameters are sharded (and their gradients averaged) over; the
// world by default, a ParallelState's data-parallel group for a model also split by tensor
// parallelism (hf::parallelize first).
std::vector<std::shared_ptr<torch::nn::Module>> fsdp2_wrap(
    torch::nn::Module& model, bool shard_root = true,
    const std::optional<MixedPrecisionPolicy>& mp_policy = std::nullopt, bool cpu_offload = false,
    const Group& group = Group::world());

}  // namespace mdist
