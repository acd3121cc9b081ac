#pragma once
// Layer 5: fully_shard, FSDP2's per-parameter sharding for torch::nn::Module trees.
//
// STATUS (the fsdp issue is open): done are dim-0 sharding with padding, nesting (a parameter
// belongs to the innermost unit), one all-gather per unit per unshard and one reduce-scatter
// per unit per backward (gradients averaged over the group), storage really freed on reshard,
// reshard_after_forward true/false, prefetch in forward and backward (order recorded in the
// first forward), forward-only use, mixed precision (param/reduce/output dtypes), ignored
// parameters, gradient sync on/off, state dicts and clip_grad_norm_ (state_dict.h).
// CPU offload too. Not yet: running on CUDA (device-aware code, untested on a GPU here).
//
// Modules call wrapped submodules through mdist::nn::call (mdist/nn/hooks.h), so that the
// unit's hooks run; a wrapped root must route its own forward through mdist::nn::hooked.
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "mdist/runtime/group.h"

namespace mdist {

struct MixedPrecisionPolicy {
  std::optional<c10::ScalarType> param_dtype;   // all-gather and compute in this dtype
  std::optional<c10::ScalarType> reduce_dtype;  // reduce-scatter gradients in this dtype
  std::optional<c10::ScalarType> output_dtype;  // cast the unit's outputs to this dtype
  bool cast_forward_inputs = true;              // cast floating inputs to param_dtype
};

// Shards and their gradients live on the CPU (pinned when CUDA is used); they are copied to
// the compute device for the all-gather and the gradients come back after the
// reduce-scatter, so the optimizer steps on the CPU.
struct CPUOffloadPolicy {
  bool pin_memory = true;
};

struct FullyShardOptions {
  Group group = Group::world();
  bool reshard_after_forward = true;
  MixedPrecisionPolicy mp_policy;
  std::optional<CPUOffloadPolicy> offload_policy;
  // Where forward and backward run. Default: the parameters' device, or with CPU offload or
  // parameters on the meta device the current CUDA device when CUDA is available, else the CPU.
  std::optional<c10::Device> device;
  // Parameters (by identity) that stay whole and replicated on every rank.
  std::vector<at::Tensor> ignored_params;
};

namespace detail {
struct FsdpUnit;
}

// A wrapped module's FSDP state. Copies refer to the same unit.
class FsdpHandle {
 public:
  explicit FsdpHandle(std::shared_ptr<detail::FsdpUnit> unit) : unit_(std::move(unit)) {}

  // Gathers the full parameters now (the forward pre-hook does this on its own).
  void unshard();
  // Frees the full parameters' storage, keeping the shards.
  void reshard();
  bool is_unsharded() const;
  // An all-gather for this unit is in flight (prefetched, not yet waited for).
  bool is_gathering() const;
  // Off: backward keeps full gradients on the unsharded parameters and skips the
  // reduce-scatter (gradient accumulation without communication); the next backward with
  // sync on reduces the accumulated sum.
  void set_requires_gradient_sync(bool sync);
  // Off: the full parameters stay gathered after backward (saves the next forward's
  // all-gather during gradient accumulation, at the cost of their memory).
  void set_reshard_after_backward(bool reshard);
  // Names (relative to the wrapped module) of the parameters this unit manages.
  std::vector<std::string> managed_parameter_names() const;
  // Shapes of one managed parameter: before sharding, and of this rank's shard.
  std::vector<int64_t> full_shape(const std::string& name) const;
  std::vector<int64_t> shard_shape(const std::string& name) const;

 private:
  std::shared_ptr<detail::FsdpUnit> unit_;
};

// Shards every parameter under `module` that no nested unit manages and that is not
// ignored, along dim 0 over the group. Afterwards module.parameters() yields the shards
// (what an optimizer steps). Wrap inner modules first, then their parents.
// Parameters on the meta device (a model built without storage, see mdist/nn/meta.h) are
// accepted: each rank allocates only its shard (zeros, to be filled e.g. by
// load_state_dict_by_rows) and the full parameters get memory only when gathered. Ignored
// meta parameters stay on meta (mdist::nn::to_empty materialises them).
// Throws Error for a module without parameters to manage, a module wrapped twice, a 0-row
// parameter, and mixed dtypes inside one unit (naming the parameters).
FsdpHandle fully_shard(torch::nn::Module& module, const FullyShardOptions& options = {});

// The handle of a wrapped module; empty when `module` was not wrapped.
std::optional<FsdpHandle> fsdp_handle(const torch::nn::Module& module);

// True if `module` or any submodule has been wrapped by fully_shard.
bool is_fsdp2_model(const torch::nn::Module& module);

}  // namespace mdist
