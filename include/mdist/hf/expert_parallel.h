#pragma once
// Expert parallelism for the mixtures of experts of hf::CausalLM (Qwen3-MoE, Qwen2-MoE,
// Mixtral): each sparse block's routed experts split over an expert-parallel group, tokens sent
// to their experts' ranks and back by all-to-all (mdist/ep/dispatch.h). Megatron's layout: the
// expert-parallel groups are carved out of the data-parallel group (dp = ep x edp), so
//
//   auto state = mdist::make_parallel_state({.expert_model_parallel = ep});
//   auto edp = mdist::make_expert_data_parallel_group({.expert_model_parallel = ep});
//   hf::parallelize_experts(model, state.expert_model_parallel_group.group());
//   hf::shard_experts(model, edp, dp);      // experts: FSDP over edp
//   mdist::fsdp2_wrap(*model);              // everything else: FSDP over dp
//
// trains like the model without expert parallelism on the same global batch (each rank its own
// share of it): the routers, attention, dense layers and embeddings see every token as before,
// and each expert's gradient sums all ranks' tokens that chose it.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/runtime/group.h"

namespace mdist::hf {

// Keeps in every sparse MoE block only this rank's experts, [r E/ep, (r+1) E/ep) for group
// rank r (the others are released: a model built on the meta device never allocates them),
// under their global names, and makes the block send tokens over `expert_parallel`. Call
// before fully_shard / fsdp2_wrap and before loading (each rank then reads only its experts).
// Throws Error for a dense model, a model already split or wrapped, or num_experts not
// divisible by the group's size. A group of one rank, or a "not used" one (ParallelState's
// with expert_model_parallel 1), changes nothing.
void parallelize_experts(CausalLM& model, const Group& expert_parallel);

// fully_shard's each sparse block's experts over `expert_data_parallel` (the ranks holding the
// same experts), their summed gradients divided by `data_parallel_size` (what fsdp2_wrap
// divides every other gradient by, so both are the global batch's mean). Call after
// parallelize_experts and before fsdp2_wrap, with the same mixed precision and offload.
void shard_experts(CausalLM& model, const Group& expert_data_parallel, int data_parallel_size,
                   const std::optional<MixedPrecisionPolicy>& mp_policy = std::nullopt,
                   bool cpu_offload = false);

// Every sparse block's routed experts, in the model's order, with the prefix of their
// parameters' names ("model.layers.0.mlp.experts"; the experts' own names follow: "5.up_proj.
// weight"): to find the parameters of split experts by name and the group they are split over
// (ExpertsImpl::expert_parallel). Empty for a dense model.
std::vector<std::pair<std::string, const ExpertsImpl*>> named_experts(CausalLM& model);

}  // namespace mdist::hf
