#pragma once
// Access to the c10d objects behind mdist's groups, for code that runs tensor collectives
// itself (the fsdp layer, users' own kernels). Includes libtorch's c10d headers.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "mdist/runtime/group.h"

namespace mdist {

// The process group of `group` (the world's default group for Group::world()). Throws
// Error when not initialized, for "not used", for non-members and for destroyed groups.
c10::intrusive_ptr<c10d::ProcessGroup> process_group(const Group& group);

// The rendezvous store of the job (a TCPStore on the master). Throws when not initialized.
c10::intrusive_ptr<c10d::Store> store();

// Waits for a collective's Work; failures become CommunicationError naming `op`, the group,
// this rank and the timeout.
void wait(const c10::intrusive_ptr<c10d::Work>& work, const Group& group, const char* op);

}  // namespace mdist
