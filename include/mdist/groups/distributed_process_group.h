#pragma once
// The spec's DistributedProcessGroup: a group that may be "not used" (-1).
#include <ostream>
#include <string>
#include <vector>

#include "mdist/objects/collectives.h"
#include "mdist/runtime/group.h"

namespace mdist {

class DistributedProcessGroup {
 public:
  // The spec's `group=None` is the world, its -1 is Group::not_used().
  DistributedProcessGroup(Group group = Group::world()) : group_(std::move(group)) {}  // NOLINT

  // False only for a "not used" group.
  bool is_initialized() const { return !group_.is_not_used(); }
  // This process's rank in the group; -1 when not used.
  int rank() const { return is_initialized() ? mdist::rank(group_) : -1; }
  // Number of ranks in the group; -1 when not used.
  int world_size() const { return is_initialized() ? mdist::size(group_) : -1; }
  const Group& group() const { return group_; }

  // "DistributedProcessGroup(group=world, rank=1, world_size=4)"
  std::string to_string() const;

  // Gathers `obj` across each group in turn and replaces it by `op(gathered)`; groups not in
  // use are skipped. E.g. the max of an amax over data parallel, then tensor parallel:
  //   get_dist_syncd_obj(amax, {dp, tp}, [](const std::vector<double>& v) {
  //     return *std::max_element(v.begin(), v.end()); });
  template <class T, class Op>
  static T get_dist_syncd_obj(T obj, const std::vector<DistributedProcessGroup>& groups, Op op) {
    for (const auto& group : groups) {
      if (!group.is_initialized()) continue;
      obj = op(allgather(obj, group.group()));
    }
    return obj;
  }
  template <class T, class Op>
  static T get_dist_syncd_obj(T obj, const DistributedProcessGroup& group, Op op) {
    return get_dist_syncd_obj(std::move(obj), std::vector<DistributedProcessGroup>{group}, op);
  }

 private:
  Group group_;
};

std::ostream& operator<<(std::ostream& os, const DistributedProcessGroup& group);

}  // namespace mdist
