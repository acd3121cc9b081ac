#pragma once
// Activation checkpointing of a CausalLM's decoder layers (mdist/nn/checkpoint.h): a marked
// layer keeps only its input hidden states in forward and runs again in backward.
//
//   hf::apply_activation_checkpointing(model, {.mode = hf::ActivationCheckpointingMode::kFull});
//   hf::apply_parallelism(model, ...);  // before wrapping, as torchtitan orders it
//
// The mark is read at each forward, so applying it after wrapping works the same; the
// checkpoint encloses the layer's hooked call, FSDP's hooks included: the recompute gathers
// the unit's parameters again through them (see src/fsdp/fsdp_state.cpp, pre_recompute).
// Not with a KV cache (generation runs under no-grad anyway).
#include <cstdint>
#include <vector>

#include "mdist/hf/causal_lm.h"

namespace mdist::hf {

enum class ActivationCheckpointingMode {
  kNone,       // every layer keeps its activations
  kFull,       // every decoder layer checkpointed
  kSelective,  // every `every`-th layer (torchtitan's selective_ac_option = "every")
};

struct ActivationCheckpointing {
  ActivationCheckpointingMode mode = ActivationCheckpointingMode::kNone;
  // kSelective: the layers whose 1-based number is a multiple of it (layers every-1,
  // 2*every-1, ... counted from 0), as torchtitan's layer-level selective checkpointing
  // counts its blocks; 1 is every layer. At least 1 (else Error).
  std::int64_t every = 2;
};

// Marks `model`'s decoder layers as `options` says (replacing an earlier mark) and returns
// the indices of the layers checkpointed.
std::vector<std::int64_t> apply_activation_checkpointing(CausalLM& model,
                                                         const ActivationCheckpointing& options);

}  // namespace mdist::hf
