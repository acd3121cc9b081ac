#pragma once
// Private: one fully_shard unit (FSDP2's FSDPParamGroup): the parameters it shards, the ones
// it keeps whole and replicated, where they live, and its training state.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/nn/hooks.h"
#include "src/fsdp/fsdp_collectives.h"
#include "src/fsdp/fsdp_param.h"

namespace mdist::detail {

class FsdpContext;

// Where a unit is in a training step; one step is kIdle -> kForward -> kIdle (forward done,
// backward pending) -> kPreBackward -> kPostBackward -> kIdle (end of the backward).
enum class TrainingState {
  kIdle,          // not in a forward or a backward
  kForward,       // between its pre- and post-forward hooks
  kPreBackward,   // its backward began (full parameters gathered again)
  kPostBackward,  // its gradients are reduced
};

// A parameter the unit keeps whole on every rank (ignored_params): not sharded, but its
// gradient is averaged over the group in the unit's post-backward, so the replicas stay equal.
struct ReplicatedParam {
  std::string name;  // relative to the unit's module
  WeakTensor tensor;
};

class FsdpParamGroup : public std::enable_shared_from_this<FsdpParamGroup> {
 public:
  torch::nn::Module* module = nullptr;
  std::string label;  // the module's type, for messages
  FullyShardOptions options;
  int world = 1;
  int rank = 0;
  std::vector<FsdpParam> params;
  std::vector<ReplicatedParam> replicated;
  int64_t flat_numel = 0;  // elements of one rank's packed shards
  c10::ScalarType shard_dtype = c10::kFloat;
  c10::ScalarType compute_dtype = c10::kFloat;
  c10::ScalarType reduce_dtype = c10::kFloat;
  c10::Device compute_device = c10::Device(c10::kCPU);  // full parameters, collectives
  c10::Device shard_device = c10::Device(c10::kCPU);    // shards and their gradients

  TrainingState state = TrainingState::kIdle;
  // Forward calls with grad enabled whose post-backward has not run: a unit called twice
  // before one backward reduces its gradients once, after both calls' backwards.
  int pending_backwards = 0;
  // Its outputs in this step required grad, so its pre-backward hook will run: the one unit
  // worth prefetching in backward.
  bool expects_pre_backward = false;
  bool unsharded = false;
  // On one rank a prefetch has nothing to overlap: it unshards at once (see unshard_locally)
  // and, like a prefetched gather, is undone if no forward or backward uses it.
  bool unsharded_by_prefetch = false;
  bool requires_gradient_sync = true;
  bool reshard_after_backward = true;
  PendingGather gather;
  // The reduce-scatter issued by post_backward, finished (shard gradients set) by
  // finish_reduce: while in flight the next unit's backward computes.
  PendingReduce reduce;
  // Bookkeeping the collectives update, also from const paths (state dict gathers).
  mutable FsdpCommStats comm;

  // The per-root state this unit belongs to; made at its root's first forward.
  std::shared_ptr<FsdpContext> context;
  std::vector<nn::HookHandle> hooks;

  ~FsdpParamGroup();

  // Whether the wrapped module (which owns the shards) still exists.
  bool alive() const;
  // Issues the all-gather of the full parameters without waiting for it (prefetch).
  void start_unshard();
  // Completes the gather (issuing it first if needed) and fills the full parameters.
  void unshard();
  // Frees the full parameters' storage, keeping the shards.
  void reshard();
  // Waits for a prefetched gather nobody will use and drops it.
  void discard_gather();
  // After the shards changed under it (a load): no gathered or in-flight copy may be used.
  void invalidate();
  // Reduces the gradients (when sync is on) and reshards (when asked to); idempotent. The
  // reduce-scatter of the sharded gradients may still be in flight afterwards: the shard
  // gradients are set by finish_reduce.
  void post_backward();
  // Waits for an in-flight reduce-scatter and sets (or accumulates into) the shard gradients.
  void finish_reduce();
  // Waits for an in-flight reduce-scatter and drops its result (a failed backward).
  void discard_reduce();
  // Drops gradients a failed backward left on the full parameters.
  void discard_full_gradients();
  // The full parameters gathered from the shards in the shards' dtype, into new tensors on
  // `device` (the unit's own full parameters are left as they are). Collective.
  std::vector<at::Tensor> gather_full_parameters(const c10::Device& device) const;

 private:
  // One rank: the full parameters are the shards' memory where dtype and device match, else
  // one cast copy of each shard; no packing, no collective.
  void unshard_locally();
  void reduce_sharded_gradients();
  // Sets shard gradient which[k] to reduced[k] (undefined: none), adding to one already there.
  void assign_gradients(const std::vector<std::size_t>& which,
                        const std::vector<at::Tensor>& reduced);
  void reduce_replicated_gradients();
};

}  // namespace mdist::detail
