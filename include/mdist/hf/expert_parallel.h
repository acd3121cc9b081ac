#pragma once
// Expert parallelism for the mixtures of experts of hf::CausalLM (Qwen3-MoE, Qwen2-MoE,
// Mixtral): each sparse block's routed experts split over an expert-parallel group, tokens sent
// to their experts' ranks and back by all-to-all (mdist/ep/dispatch.h). Megatron's layout: the
// expert-parallel groups are carved out of the data-parallel group (dp = ep x edp), so
//
//   auto state = mdist::make_parallel_state({.expert_model_parallel = ep});
//   auto edp = mdist::make_expert_data_parallel_group({.expert_model_parallel = ep});
//   auto plan = hf::parallelize_experts(model, state.expert_model_parallel_group.group());
//   hf::shard_experts(model, edp, dp);      // experts: FSDP over edp
//   mdist::fsdp2_wrap(*model);              // everything else: FSDP over dp
//
// (hf::apply_parallelism in mdist/hf/parallelize.h does all of it), as torchtitan: the model's
// experts only compute the experts they hold on the rows they are given (GroupedExpertsImpl),
// and the expert-parallel style (ep::ExpertParallel) installed on them here sends the rows to
// their owners and back in its forward hooks. The plan is held beside the model: saving a split
// model, its gradient norm and its optimizer checkpoints take it.
//
// trains like the model without expert parallelism on the same global batch (each rank its own
// share of it): the routers, attention, dense layers and embeddings see every token as before,
// and each expert's gradient sums all ranks' tokens that chose it.
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <memory>

#include "mdist/ep/dispatch.h"
#include "mdist/fsdp/fully_shard.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/runtime/group.h"

namespace mdist::hf {

// How a model's experts are split over an expert-parallel group: the group, which experts this
// rank holds, and the style installed on each sparse block's experts (each with its own
// counters, as FSDP's units).
class ExpertParallelPlan {
 public:
  ExpertParallelPlan(Group group, int64_t num_experts, std::vector<ep::ExpertParallel> styles);
  const Group& group() const { return group_; }
  int64_t num_experts() const { return num_experts_; }
  ep::ExpertRange owned() const;  // this rank's experts, the same in every block
  // The all-to-alls of every block since the split or the last reset, summed.
  ep::CommStats communication() const;
  void reset_communication() const;

 private:
  Group group_;
  int64_t num_experts_;
  std::vector<ep::ExpertParallel> styles_;
};

// Keeps in every sparse MoE block only this rank's experts, [r E/ep, (r+1) E/ep) for group
// rank r (the others are released: a model built on the meta device never allocates them),
// under their global names, and installs the expert-parallel style on them (tokens sent over
// `expert_parallel`). Returns the plan; null when nothing is split: a group of one rank, or a
// "not used" one (ParallelState's with expert_model_parallel 1). Call before fully_shard /
// fsdp2_wrap and before loading (each rank then reads only its experts). Throws Error for a
// dense model, a model already split or wrapped, or num_experts not divisible by the group's
// size.
std::shared_ptr<const ExpertParallelPlan> parallelize_experts(CausalLM& model,
                                                              const Group& expert_parallel);

// Whether some sparse block holds fewer experts than the layer has (parallelize_experts ran).
bool is_expert_parallel_split(CausalLM& model);

// fully_shard's each sparse block's experts over `expert_data_parallel` (the ranks holding the
// same experts), their summed gradients divided by `data_parallel_size` (what fsdp2_wrap
// divides every other gradient by, so both are the global batch's mean). Call after
// parallelize_experts and before fsdp2_wrap, with the same mixed precision and offload.
void shard_experts(CausalLM& model, const Group& expert_data_parallel, int data_parallel_size,
                   const std::optional<MixedPrecisionPolicy>& mp_policy = std::nullopt,
                   bool cpu_offload = false);

// The parameters of the experts split over an expert-parallel group, by (global) name, each
// with whether this rank holds their first copy among the ranks holding them (its
// expert-data-parallel group): the ranks of the expert-parallel group that holds the
// data-parallel group's first rank (Megatron's layout: expert-parallel groups are consecutive
// chunks of the data-parallel group, expert-data-parallel groups take one rank from each).
// For what is written or counted once per expert (optimizer checkpoints, gradient norms).
// Empty when the experts are not split (a null plan).
std::map<std::string, bool> split_expert_parameters(
    CausalLM& model, const std::shared_ptr<const ExpertParallelPlan>& plan,
    const Group& data_parallel = Group::world());

// Every sparse block's routed experts, in the model's order, with the prefix of their
// parameters' names ("model.layers.0.mlp.experts"; the experts' own names follow: "5.up_proj.
// weight"): to find the parameters of split experts by name (ExpertsImpl::first and local say
// which experts a block holds). Empty for a dense model.
std::vector<std::pair<std::string, const ExpertsImpl*>> named_experts(CausalLM& model);

}  // namespace mdist::hf
