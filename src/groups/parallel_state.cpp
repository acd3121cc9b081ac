#include "mdist/groups/parallel_state.h"

#include <sstream>

#include "mdist/error.h"
#include "mdist/runtime/runtime.h"

namespace mdist {

std::string ParallelState::to_string() const {
  std::ostringstream out;
  out << "ParallelState(data_parallel_group=" << data_parallel_group
      << ", tensor_parallel_group=" << tensor_parallel_group
      << ", expert_model_parallel_group=" << expert_model_parallel_group << ")";
  return out.str();
}

std::ostream& operator<<(std::ostream& os, const ParallelState& state) {
  return os << state.to_string();
}

ParallelLayout parallel_layout(int world_size, const ParallelSizes& sizes) {
  const int tp = sizes.tensor_parallel;
  const int ep = sizes.expert_model_parallel;
  if (world_size < 1) throw Error("mdist: parallel_layout: world size must be positive");
  if (tp < 1) {
    throw Error("mdist: tensor_parallel must be at least 1, got " + std::to_string(tp));
  }
  if (ep < 1) {
    throw Error("mdist: expert_model_parallel must be at least 1, got " + std::to_string(ep));
  }
  if (world_size % tp != 0) {
    throw Error("mdist: world size " + std::to_string(world_size) +
                " is not divisible by tensor_parallel " + std::to_string(tp));
  }
  const int dp = world_size / tp;
  if (dp % ep != 0) {
    throw Error("mdist: data parallel size " + std::to_string(dp) + " (world size " +
                std::to_string(world_size) + " / tensor_parallel " + std::to_string(tp) +
                ") is not divisible by expert_model_parallel " + std::to_string(ep));
  }
  ParallelLayout layout;
  layout.data_parallel = dp;
  for (int block = 0; block < dp; ++block) {
    std::vector<int> group;
    for (int i = 0; i < tp; ++i) group.push_back(block * tp + i);
    layout.tensor_parallel_groups.push_back(std::move(group));
  }
  for (int offset = 0; offset < tp; ++offset) {
    std::vector<int> group;
    for (int block = 0; block < dp; ++block) group.push_back(block * tp + offset);
    for (int chunk = 0; chunk < dp / ep; ++chunk) {
      layout.expert_model_parallel_groups.emplace_back(group.begin() + chunk * ep,
                                                       group.begin() + (chunk + 1) * ep);
    }
    for (int position = 0; position < ep; ++position) {
      std::vector<int> experts_dp;
      for (int chunk = 0; chunk < dp / ep; ++chunk)
        experts_dp.push_back(group[chunk * ep + position]);
      layout.expert_data_parallel_groups.push_back(std::move(experts_dp));
    }
    layout.data_parallel_groups.push_back(std::move(group));
  }
  return layout;
}

namespace {

// Creates every group in `groups` (all ranks, same order) and keeps the one holding `me`.
Group make_groups(const std::vector<std::vector<int>>& groups, int me) {
  Group mine = Group::not_used();
  for (const auto& ranks : groups) {
    Group group = new_group(ranks);
    if (group.is_member()) mine = group;
  }
  if (mine.is_not_used()) {
    throw Error("mdist: parallel layout has no group for rank " + std::to_string(me));
  }
  return mine;
}

}  // namespace

ParallelState make_parallel_state(const ParallelSizes& sizes) {
  const int world_size = size();
  const ParallelLayout layout = parallel_layout(world_size, sizes);
  const int me = rank();
  const Group tp = sizes.tensor_parallel == 1 ? Group::not_used()
                                              : make_groups(layout.tensor_parallel_groups, me);
  const Group dp = layout.data_parallel == world_size
                       ? Group::world()
                       : make_groups(layout.data_parallel_groups, me);
  const Group ep = sizes.expert_model_parallel == 1
                       ? Group::not_used()
                       : make_groups(layout.expert_model_parallel_groups, me);
  return ParallelState(dp, tp, ep);
}

Group make_expert_data_parallel_group(const ParallelSizes& sizes) {
  const int world_size = size();
  const ParallelLayout layout = parallel_layout(world_size, sizes);
  if (layout.expert_data_parallel_groups.size() == 1 &&
      static_cast<int>(layout.expert_data_parallel_groups.front().size()) == world_size) {
    return Group::world();
  }
  return make_groups(layout.expert_data_parallel_groups, rank());
}

}  // namespace mdist
