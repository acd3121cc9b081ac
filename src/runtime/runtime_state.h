#pragma once
// Private: the one piece of global state mdist keeps, the job this process joined.
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "mdist/runtime/environment.h"
#include "src/runtime/group_state.h"

namespace gloo::transport {
class Device;
}

namespace mdist::detail {

struct RuntimeState {
  LaunchEnv env;
  std::string backend_spec;
  std::chrono::milliseconds timeout{0};
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<::gloo::transport::Device> gloo_device;  // shared by every Gloo group
  std::string gloo_endpoint;  // the device's address and why it was chosen, for error messages
  std::shared_ptr<GroupState> world;
  std::vector<std::shared_ptr<GroupState>> groups;  // every group made, destroyed on cleanup
  int next_group_id = 1;
};

// Empty when not initialized.
std::optional<RuntimeState>& runtime_state();

// Builds the process group of `size` ranks for one group over `store` (already prefixed),
// with the backends the job's backend spec names.
c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(
    RuntimeState& state, const c10::intrusive_ptr<c10d::Store>& store, int group_rank, int size,
    std::chrono::milliseconds timeout, const std::string& name, c10::Device& object_device);

}  // namespace mdist::detail
