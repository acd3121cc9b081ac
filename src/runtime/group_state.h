#pragma once
// Private: what stands behind a Group handle, and the helpers every collective uses.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "mdist/runtime/group.h"

namespace mdist::detail {

struct GroupState {
  int id = 0;              // 0 is the world
  std::vector<int> ranks;  // global ranks, in group-rank order
  int group_rank = -1;     // this process's rank in the group; -1 when not a member
  std::chrono::milliseconds timeout{0};
  c10::intrusive_ptr<c10d::ProcessGroup> pg;  // null for non-members and once destroyed
  bool destroyed = false;
  // Where object collectives put their byte buffers: CPU when the group has a CPU backend.
  c10::Device object_device = c10::Device(c10::kCPU);

  std::string name() const;
};

// The state behind `group` for a collective called `op`. Returns nullptr when mdist is not
// initialized and `group` is the world (the spec's single-process case). Throws Error for a
// "not used" group, a group this process is not in, or a destroyed group.
std::shared_ptr<GroupState> resolve(const Group& group, const char* op);

// Whether `group` is a live concrete group this process is not in: there rank() and size()
// are -1 and barrier() returns at once, as in torch.distributed.
bool is_outside(const Group& group);

// Waits for `work`; a failure becomes one CommunicationError naming the operation, the
// group, this rank and the timeout.
void wait_work(const c10::intrusive_ptr<c10d::Work>& work, const GroupState& group, const char* op);

// The first line of an exception's message, without libtorch's backtrace or source prefix.
std::string first_line(const std::exception& error);

}  // namespace mdist::detail
