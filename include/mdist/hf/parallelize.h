#pragma once
// The one parallelization recipe for hf::CausalLM, as torchtitan's parallelize_*: the model
// file stays the plain transformers-shaped model, and apply_parallelism splits and wraps it in
// place for a layout, returning what it did (hf::Parallelism) for the code that needs to know:
// the loss and the full logits of a vocabulary-split model, the gradient norm, saving and
// loading. Every path that builds a model (seeded, loaded whole, loaded on the meta device)
// goes through it, so they cannot drift apart:
//
//   1. tensor parallelism over the layout's tensor-parallel group (hf::parallelize)
//   2. expert parallelism over its expert-parallel group (hf::parallelize_experts)
//   3. the model moved to the compute device (not a model on the meta device: FSDP gives its
//      shards memory there)
//   4. the experts FSDP-sharded over the expert-data-parallel group (hf::shard_experts)
//   5. everything else FSDP-sharded over the data-parallel group (fsdp2_wrap)
//
//   auto state = mdist::make_parallel_state({.tensor_parallel = tp});
//   hf::CausalLM model(config);
//   const hf::Parallelism parallelism = hf::apply_parallelism(model, {.parallel = state});
//   hf::causal_lm_loss(parallelism, model->forward(ids), ids).backward();
//   hf::clip_grad_norm_(model, parallelism, 1.0);
//   hf::save_pretrained(model, parallelism, dir);
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/groups/parallel_state.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/hf/expert_parallel.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/runtime/group.h"

namespace mdist::hf {

// The groups a model is split over. Every group is made collectively by the caller (the
// recipe itself makes none but the replicated-KV-head subgroups of hf::parallelize).
struct ParallelLayout {
  // Data, tensor and expert parallel (expert-parallel groups carved out of data parallel).
  ParallelState parallel = ParallelState();
  // The ranks holding the same experts (mdist::make_expert_data_parallel_group); required when
  // the expert-parallel group has more than one rank and `fsdp` is on.
  std::optional<Group> expert_data_parallel = std::nullopt;
};

struct ParallelizeOptions {
  // FSDP2 over data parallel (experts over expert-data parallel); off: split only.
  bool fsdp = true;
  bool shard_root = true;  // fsdp2_wrap's
  std::optional<MixedPrecisionPolicy> mp_policy = std::nullopt;
  bool cpu_offload = false;
  // Where a model with storage is moved after the splits (before FSDP, which then shards on
  // it); nullopt: left where it is. Ignored for a model on the meta device.
  std::optional<c10::Device> device = std::nullopt;
};

// Communication of a parallelized model's tensor- and expert-parallel handles since they were
// made or last reset (FSDP's own is per unit: FsdpHandle::communication).
struct ParallelCommStats {
  int64_t tensor_parallel_all_reduce_bytes = 0;
  int64_t tensor_parallel_all_gather_bytes = 0;
  int64_t all_to_alls = 0;
  int64_t all_to_all_bytes = 0;  // rows sent to other ranks, forward and backward
};

// How a model is split: held beside the model, not in it. An empty one is an unsplit model.
// Copies share the plans (and their counters).
struct Parallelism {
  // Null when the model is not split over a tensor-parallel group of more than one rank.
  std::shared_ptr<const TensorParallelPlan> tensor_parallel = nullptr;
  // Null when every expert is on every rank.
  std::shared_ptr<const ExpertParallelPlan> expert_parallel = nullptr;

  bool tensor_parallel_split() const { return tensor_parallel && tensor_parallel->size() > 1; }
  // The sum over both plans' handles.
  ParallelCommStats communication() const;
  void reset_communication() const;
};

// Applies the recipe above to `model` (on the CPU or the meta device, not yet wrapped) for
// `layout`. Collective over the world (KV-head subgroups, FSDP). Throws Error for a split
// that cannot work (check_tensor_parallel_split), for expert parallelism of a dense model or
// without layout.expert_data_parallel when it is needed.
Parallelism apply_parallelism(CausalLM& model, const ParallelLayout& layout,
                              const ParallelizeOptions& options = {});

// A model and how it is split (what load_pretrained_fsdp2 and mdist's model builders return).
struct ParallelModel {
  CausalLM model{nullptr};
  Parallelism parallelism;
};

// HF's causal-LM loss of the model's logits: hf::causal_lm_loss, or the tensor-parallel plan's
// vocab-parallel loss when the model's vocabulary is split.
at::Tensor causal_lm_loss(const Parallelism& parallelism, const at::Tensor& logits,
                          const at::Tensor& labels);
// The logits over the whole vocabulary (gathered when the model is split).
at::Tensor full_logits(const Parallelism& parallelism, const at::Tensor& logits);

// clip_grad_norm_ of the model, split or not, wrapped by fsdp2_wrap or not: the global norm
// counts each distinct value once (split parts summed over the tensor-parallel and
// data-parallel ranks, replicated ones once). Wrapped, the data-parallel x tensor-parallel
// ranks must be the world. Under expert parallelism each expert counts once too (its shards
// over its expert-data-parallel group).
double clip_grad_norm_(CausalLM& model, const Parallelism& parallelism, double max_norm,
                       double norm_type = 2.0);

}  // namespace mdist::hf
