#pragma once
// The spec's ParallelState, and a factory that builds its groups from sizes.
#include <ostream>
#include <string>
#include <vector>

#include "mdist/groups/distributed_process_group.h"

namespace mdist {

class ParallelState {
 public:
  // Defaults as in the spec: data parallel over the world, tensor and expert parallel unused.
  explicit ParallelState(Group data_parallel = Group::world(),
                         Group tensor_parallel = Group::not_used(),
                         Group expert_model_parallel = Group::not_used())
      : data_parallel_group(std::move(data_parallel)),
        tensor_parallel_group(std::move(tensor_parallel)),
        expert_model_parallel_group(std::move(expert_model_parallel)) {}

  DistributedProcessGroup data_parallel_group;
  DistributedProcessGroup tensor_parallel_group;
  DistributedProcessGroup expert_model_parallel_group;

  // "ParallelState(data_parallel_group=..., tensor_parallel_group=..., expert_model_...)"
  std::string to_string() const;
};

std::ostream& operator<<(std::ostream& os, const ParallelState& state);

struct ParallelSizes {
  int tensor_parallel = 1;
  int expert_model_parallel = 1;
};

// Which global ranks form each group, for a world of `world_size` ranks (Megatron's layout):
// tensor-parallel groups are contiguous blocks of `tensor_parallel` ranks; data-parallel
// groups take one rank from each block (stride `tensor_parallel`); expert-parallel groups
// split each data-parallel group into consecutive chunks of `expert_model_parallel` ranks.
// data parallel size = world_size / tensor_parallel. Throws Error on sizes that do not fit.
struct ParallelLayout {
  int data_parallel = 1;
  std::vector<std::vector<int>> tensor_parallel_groups;
  std::vector<std::vector<int>> data_parallel_groups;
  std::vector<std::vector<int>> expert_model_parallel_groups;
  // Beyond the spec: for each rank, the ranks of its data-parallel group at the same position
  // in their expert-parallel chunks (dp / ep ranks): the group expert parameters are
  // FSDP-sharded over while every other parameter is sharded over the data-parallel group.
  std::vector<std::vector<int>> expert_data_parallel_groups;
};
ParallelLayout parallel_layout(int world_size, const ParallelSizes& sizes);

// Builds every group of the layout (collective: every rank calls it with the same sizes) and
// returns this rank's ParallelState. A size of 1 leaves that parallelism "not used"; a data
// parallel group spanning the whole world is the world itself.
ParallelState make_parallel_state(const ParallelSizes& sizes);

// Builds the expert-data-parallel groups of the layout (collective, like make_parallel_state)
// and returns this rank's; with expert_model_parallel 1 it is the data-parallel group.
Group make_expert_data_parallel_group(const ParallelSizes& sizes);

}  // namespace mdist
