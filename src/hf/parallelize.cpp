// hf::apply_parallelism: the one recipe that splits and wraps a CausalLM, and what takes its
// result (the loss, the full logits, the gradient norm).
#include "mdist/hf/parallelize.h"

#include <map>
#include <string>
#include <utility>

#include "mdist/error.h"
#include "mdist/fsdp/state_dict.h"
#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/nn/meta.h"
#include "mdist/runtime/runtime.h"

namespace mdist::hf {

ParallelCommStats Parallelism::communication() const {
  ParallelCommStats stats;
  if (tensor_parallel) {
    const tp::CommunicationBytes bytes = tensor_parallel->communication();
    stats.tensor_parallel_all_reduce_bytes = bytes.all_reduce;
    stats.tensor_parallel_all_gather_bytes = bytes.all_gather;
  }
  if (expert_parallel) {
    const ep::CommStats sent = expert_parallel->communication();
    stats.all_to_alls = sent.all_to_alls;
    stats.all_to_all_bytes = sent.bytes_sent;
  }
  return stats;
}

void Parallelism::reset_communication() const {
  if (tensor_parallel) tensor_parallel->reset_communication();
  if (expert_parallel) expert_parallel->reset_communication();
}

Parallelism apply_parallelism(CausalLM& model, const ParallelLayout& layout,
                              const ParallelizeOptions& options) {
  const ParallelState& state = layout.parallel;
  Parallelism parallelism;
  // 1. Tensor parallelism: the modules cut to this rank's heads, features and vocabulary.
  if (state.tensor_parallel_group.world_size() > 1) {
    parallelism.tensor_parallel = parallelize(model, state);
  }
  // 2. Expert parallelism: each sparse block keeps this rank's experts, dispatched to by
  // all-to-all.
  const bool split_experts = state.expert_model_parallel_group.world_size() > 1;
  if (split_experts) {
    if (options.fsdp && !layout.expert_data_parallel) {
      throw Error(
          "mdist: hf::apply_parallelism: an expert-parallel layout needs "
          "ParallelLayout::expert_data_parallel (make_expert_data_parallel_group)");
    }
    parallelism.expert_parallel =
        parallelize_experts(model, state.expert_model_parallel_group.group());
  }
  // 3. The device: a model with storage computes where it lives; FSDP gives a meta model's
  // shards memory on the compute device itself.
  if (options.device && !nn::has_meta_tensors(*model)) model->to(*options.device);
  if (!options.fsdp) return parallelism;
  const Group dp = state.data_parallel_group.group();
  // 4. The experts: FSDP over the ranks holding the same experts, their gradients divided by
  // dp as everything else's (the all-to-all has already summed the ep ranks' tokens).
  if (split_experts) {
    shard_experts(model, *layout.expert_data_parallel, state.data_parallel_group.world_size(),
                  options.mp_policy, options.cpu_offload);
  }
  // 5. Everything else: FSDP over data parallel (each decoder layer, then the root).
  fsdp2_wrap(*model, options.shard_root, options.mp_policy, options.cpu_offload, dp);
  return parallelism;
}

at::Tensor causal_lm_loss(const Parallelism& parallelism, const at::Tensor& logits,
                          const at::Tensor& labels) {
  if (parallelism.tensor_parallel) return parallelism.tensor_parallel->loss(logits, labels);
  return causal_lm_loss(logits, labels);
}

at::Tensor full_logits(const Parallelism& parallelism, const at::Tensor& logits) {
  return parallelism.tensor_parallel ? parallelism.tensor_parallel->full_logits(logits) : logits;
}

namespace {

// Under expert parallelism every shard counts where it is (the experts' rows are spread over
// their expert-data-parallel groups, the rest over data parallel, which is the world: expert
// parallelism excludes tensor parallelism), each rank's experts being its own; a whole
// parameter counts on one rank: an expert on the first of the ranks holding it, anything else
// (an fp32 router fsdp2_wrap keeps whole, or a model without units) on rank 0.
GradNormScope expert_parallel_scope(CausalLM& model, const Parallelism& parallelism) {
  const auto experts = split_expert_parameters(model, parallelism.expert_parallel);
  std::map<std::string, bool> counted;
  for (const auto& [name, place] : param_placements(*model)) {
    const auto expert = experts.find(name);
    counted[name] = place.sharded || (expert != experts.end() ? expert->second : is_master());
  }
  GradNormScope scope;
  scope.counted = [counted = std::move(counted)](const std::string& name) {
    const auto it = counted.find(name);
    return it == counted.end() || it->second;
  };
  scope.group = Group::world();
  return scope;
}

}  // namespace

double clip_grad_norm_(CausalLM& model, const Parallelism& parallelism, double max_norm,
                       double norm_type) {
  if (parallelism.expert_parallel) {
    return mdist::clip_grad_norm_(*model, max_norm, norm_type,
                                  expert_parallel_scope(model, parallelism));
  }
  const auto& plan = parallelism.tensor_parallel;
  if (!plan || plan->size() == 1) {
    if (is_tensor_parallel_split(model) || is_expert_parallel_split(model)) {
      throw Error(
          "mdist: hf::clip_grad_norm_: the model is split; pass the Parallelism "
          "apply_parallelism returned");
    }
    return mdist::clip_grad_norm_(*model, max_norm, norm_type);
  }
  GradNormScope scope;
  scope.counted = [&plan](const std::string& name) { return plan->placement(name).primary; };
  scope.group = is_fsdp2_model(*model) ? Group::world() : plan->group();
  return mdist::clip_grad_norm_(*model, max_norm, norm_type, scope);
}

}  // namespace mdist::hf
