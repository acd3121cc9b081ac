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

  // As the reference: true when mdist is initialized and the group is not "not used". A plain
  // process (not initialized) is false for every group, so rank() and world_size() are -1.
  bool is_initialized() const { return mdist::is_initialized() && !group_.is_not_used(); }
  // This process's rank in the group; -1 when not initialized, and for a group this process
  // is not in (torch.distributed's get_rank).
  int rank() const { return is_initialized() ? mdist::rank(group_) : -1; }
  // Number of ranks in the group; -1 when not initialized, and for a group this process is
  // not in (torch.distributed's get_world_size).
  int world_size() const { return is_initialized() ? mdist::size(group_) : -1; }
  const Group& group() const { return group_; }

  // "DistributedProcessGroup(group=world, rank=1, world_size=4)"
  std::string to_string() const;

  // Gathers `obj` across each group in turn and replaces it by `op(gathered)`, e.g. the max of
  // an amax over data parallel, then tensor parallel:
  //   get_dist_syncd_obj(amax, {dp, tp}, [](const std::vector<double>& v) {
  //     return *std::max_element(v.begin(), v.end()); });
  // As the reference: a group that is not initialized (not used, or mdist not initialized)
  // leaves `obj` as it is; on a group this process is not in, `op` gets an empty vector
  // (torch's all_gather_object does nothing there), so an `op` for such layouts must accept one.
  template <class T, class Op>
  static T get_dist_syncd_obj(T obj, const std::vector<DistributedProcessGroup>& groups, Op op) {
    for (const auto& group : groups) {
      if (!group.is_initialized()) continue;
      if (!group.group().is_member()) {
        obj = op(std::vector<T>());
        continue;
      }
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
