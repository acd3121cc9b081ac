#pragma once
// The job's parallel layout from --tp and --ep: their checks against the world and the model,
// the groups, and the line that describes them.
#include <algorithm>
#include <optional>
#include <string>

#include "mdist/groups/parallel_state.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/runtime/group.h"

namespace mdist::cli {

// The job's groups: the spec's ParallelState (data, tensor and expert parallel) and, with
// expert parallelism, the expert-data-parallel group (the ranks holding the same experts, over
// which the experts are FSDP-sharded; Megatron's layout, dp = ep x edp).
struct JobLayout {
  ParallelState parallel;
  std::optional<Group> expert_data_parallel;  // set when --ep > 1
  int tensor_parallel() const { return std::max(1, parallel.tensor_parallel_group.world_size()); }
  int expert_parallel() const {
    return std::max(1, parallel.expert_model_parallel_group.world_size());
  }
};
// Checks --tp against the world and the model (InputError naming the sizes); call inside
// agree_on_inputs.
void check_tensor_parallel_size(int tensor_parallel);  // >= 1 and dividing the world
void check_tensor_parallel(int tensor_parallel, const hf::LlamaConfig& config);
// Checks --ep: >= 1 and dividing the data-parallel size (world / tp); and against the model:
// a mixture of experts whose num_experts it divides, without tensor parallelism (InputError
// naming the sizes). Call inside agree_on_inputs, after the --tp checks.
void check_expert_parallel_size(int expert_parallel, int tensor_parallel);
void check_expert_parallel(int expert_parallel, int tensor_parallel, const hf::LlamaConfig& config);
// The job's layout for --tp and --ep (collective; after the inputs are agreed on).
JobLayout make_layout(int tensor_parallel, int expert_parallel = 1);
// "4 rank(s) as dp 2 x tp 2", with ", ep 2 (experts: 2 per group of 4 ... )" under --ep.
std::string describe_layout(const JobLayout& layout);

}  // namespace mdist::cli
