// Expert parallelism for hf::CausalLM: which experts a rank keeps, and their FSDP units.
#include "mdist/hf/expert_parallel.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "mdist/ep/dispatch.h"
#include "mdist/error.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/nn/meta.h"
#include "mdist/runtime/device.h"
#include "mdist/runtime/runtime.h"

namespace mdist::hf {
namespace {

std::vector<SparseMoeBlock> sparse_blocks(CausalLM& model, const char* op) {
  std::vector<SparseMoeBlock> blocks;
  for (auto& layer : model->model->decoder_layers) {
    if (layer->moe) blocks.push_back(layer->moe);
  }
  if (blocks.empty()) {
    throw Error(std::string("mdist: hf::") + op +
                ": the model has no mixture-of-experts layer (a dense " + model->config.model_type +
                ")");
  }
  return blocks;
}

}  // namespace

ExpertParallelPlan::ExpertParallelPlan(Group group, int64_t num_experts,
                                       std::vector<ep::ExpertParallel> styles)
    : group_(std::move(group)), num_experts_(num_experts), styles_(std::move(styles)) {}

ep::ExpertRange ExpertParallelPlan::owned() const {
  return ep::owned_experts(num_experts_, group_);
}

ep::CommStats ExpertParallelPlan::communication() const {
  ep::CommStats sum;
  for (const auto& style : styles_) {
    const ep::CommStats one = style.communication();
    sum.all_to_alls += one.all_to_alls;
    sum.bytes_sent += one.bytes_sent;
  }
  return sum;
}

void ExpertParallelPlan::reset_communication() const {
  for (const auto& style : styles_) style.reset_communication();
}

bool is_expert_parallel_split(CausalLM& model) {
  for (const auto& layer : model->model->decoder_layers) {
    if (layer->moe && static_cast<int64_t>(layer->moe->experts->local.size()) !=
                          layer->moe->experts->num_experts) {
      return true;
    }
  }
  return false;
}

std::shared_ptr<const ExpertParallelPlan> parallelize_experts(CausalLM& model,
                                                              const Group& expert_parallel) {
  auto blocks = sparse_blocks(model, "parallelize_experts");
  if (is_fsdp2_model(*model)) {
    throw Error(
        "mdist: hf::parallelize_experts: the model is already wrapped by fully_shard; "
        "split the experts first, then fsdp2_wrap");
  }
  if (is_tensor_parallel_split(model)) {
    throw Error(
        "mdist: hf::parallelize_experts: tensor parallelism of a mixture of experts is "
        "not supported");
  }
  // ParallelState's group with expert_model_parallel 1 is "not used": no expert parallelism.
  if (expert_parallel.is_not_used()) return nullptr;
  const int ranks = size(expert_parallel);
  if (ranks < 0) {
    throw Error("mdist: hf::parallelize_experts: this rank is not a member of " +
                expert_parallel.name());
  }
  if (is_expert_parallel_split(model)) {
    throw Error("mdist: hf::parallelize_experts: the experts are already split");
  }
  if (ranks == 1) return nullptr;
  const int64_t num_experts = blocks.front()->experts->num_experts;
  std::vector<ep::ExpertParallel> styles;
  for (auto& block : blocks) {
    const Experts& all = block->experts;
    const ep::ExpertRange mine = ep::owned_experts(all->num_experts, expert_parallel);
    std::vector<MLP> kept(all->local.begin() + mine.first,
                          all->local.begin() + mine.first + mine.count);
    // The block's old container, and with it the experts of other ranks, goes here.
    block->experts =
        block->replace_module("experts", Experts(std::move(kept), mine.first, all->num_experts));
    styles.emplace_back(expert_parallel, block->experts->num_experts);
    styles.back().apply(*block->experts->grouped);
  }
  return std::make_shared<const ExpertParallelPlan>(expert_parallel, num_experts,
                                                    std::move(styles));
}

void shard_experts(CausalLM& model, const Group& expert_data_parallel, int data_parallel_size,
                   const std::optional<MixedPrecisionPolicy>& mp_policy, bool cpu_offload) {
  auto blocks = sparse_blocks(model, "shard_experts");
  if (data_parallel_size < 1) {
    throw Error("mdist: hf::shard_experts: data_parallel_size must be positive, got " +
                std::to_string(data_parallel_size));
  }
  FullyShardOptions options;
  options.group = expert_data_parallel;
  options.reshard_after_forward = true;
  options.gradient_divide_factor = data_parallel_size;
  if (mp_policy) options.mp_policy = *mp_policy;
  if (cpu_offload) options.offload_policy = CPUOffloadPolicy{};
  // As fsdp2_wrap: a model on the meta device computes on this rank's device.
  if (nn::has_meta_tensors(*model)) options.device = compute_device();
  for (auto& block : blocks) {
    if (block->experts->local.empty()) continue;
    fully_shard(*block->experts, options);
  }
}

std::map<std::string, bool> split_expert_parameters(
    CausalLM& model, const std::shared_ptr<const ExpertParallelPlan>& plan,
    const Group& data_parallel) {
  std::map<std::string, bool> params;
  if (!plan) return params;
  const std::vector<int> dp = data_parallel.ranks();
  const int first_dp_rank = dp.empty() ? 0 : dp.front();
  const std::vector<int> ep = plan->group().ranks();
  const bool first = std::find(ep.begin(), ep.end(), first_dp_rank) != ep.end();
  for (const auto& [prefix, experts] : named_experts(model)) {
    for (const auto& param : experts->named_parameters()) {
      params[prefix + "." + param.key()] = first;
    }
  }
  return params;
}

std::vector<std::pair<std::string, const ExpertsImpl*>> named_experts(CausalLM& model) {
  std::vector<std::pair<std::string, const ExpertsImpl*>> found;
  for (const auto& item : model->named_modules("", /*include_self=*/false)) {
    if (const auto* experts = dynamic_cast<const ExpertsImpl*>(item.value().get())) {
      found.emplace_back(item.key(), experts);
    }
  }
  return found;
}

}  // namespace mdist::hf
