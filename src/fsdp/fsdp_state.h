#pragma once
// Private: the state fully_shard keeps beside the module tree (FSDP2's _fsdp_state): which
// module is which unit, which registered tensor is which unit's shard, the per-root context
// (forward order for prefetching, the end-of-backward callback), and the forward hooks and
// autograd nodes that drive a unit through a training step.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "src/fsdp/fsdp_param_group.h"

namespace mdist::detail {

// The state of one root: every unit under the module whose forward began a pass first, as in
// FSDP2, where the root lazily initialises its subtree. Two models in one process (teacher and
// student, two students) have two contexts, and one's backward does not finish the other's.
class FsdpContext {
 public:
  // The units, in module order (the same on every rank): the end of a backward finishes them
  // in this order.
  std::vector<std::weak_ptr<FsdpParamGroup>> units;
  // The units in the order their forwards began / ended in the last complete pass: the next
  // one to gather in forward is the next in the first, in backward the previous in the second.
  std::vector<std::weak_ptr<FsdpParamGroup>> pre_forward_order;
  std::vector<std::weak_ptr<FsdpParamGroup>> post_forward_order;
  // The pass in progress.
  std::vector<FsdpParamGroup*> pass_pre_order;
  std::vector<FsdpParamGroup*> pass_post_order;
  bool pass_follows_order = true;  // so far as recorded: forward prefetch may use it
  int depth = 0;                   // unit forwards in progress on this root
  // The end-of-backward callback is queued in the backward (graph task) that ran the first
  // pre-backward hook; if that backward failed it never runs, which the next pass notices.
  bool final_callback_queued = false;
  int callback_graph_task = -1;
  // The unit whose gradient reduce-scatter is in flight (finished at the next unit's
  // post-backward or at the end of the backward).
  std::weak_ptr<FsdpParamGroup> reducing;
};

// The registry of units, by module and by shard.
void register_unit(const std::shared_ptr<FsdpParamGroup>& unit);
std::shared_ptr<FsdpParamGroup> unit_of(const torch::nn::Module& module);
// Drops the units of modules that no longer exist.
void sweep_units();

// One managed parameter, found by the tensor parameters() yields for it (its shard).
struct ManagedRef {
  std::shared_ptr<FsdpParamGroup> unit;
  std::size_t index = 0;
  const FsdpParam& param() const { return unit->params[index]; }
};
std::optional<ManagedRef> find_managed(const at::Tensor& registered);

// Registers the forward hooks that drive `unit`.
void install_hooks(const std::shared_ptr<FsdpParamGroup>& unit);

}  // namespace mdist::detail
