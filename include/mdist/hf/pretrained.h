#pragma once
// Saving and loading a whole Hugging Face checkpoint directory: config.json plus safetensors
// (one file, or shards with model.safetensors.index.json above a size), the layout
// transformers' save_pretrained writes and from_pretrained reads.
#include <cstdint>
#include <filesystem>

#include "mdist/hf/causal_lm.h"

namespace mdist::hf {

// Writes `model` (wrapped by fully_shard or not) to `dir`. A sharded model is gathered first:
// collective, every rank calls it; rank 0 writes. Every file is written atomically.
void save_pretrained(CausalLM& model, const std::filesystem::path& dir,
                     std::uint64_t max_shard_bytes = std::uint64_t{5} << 30);

// Builds the model from dir/config.json and loads its weights by name.
CausalLM load_pretrained(const std::filesystem::path& dir);

// Loads dir's weights into `model` that is already wrapped (fsdp2_wrap / fully_shard): each
// rank reads only the rows it owns straight from the memory-mapped safetensors files, so no
// rank holds a full copy of the sharded weights. Also works on an unwrapped model.
void load_checkpoint_sharded(torch::nn::Module& model, const std::filesystem::path& dir);

}  // namespace mdist::hf
