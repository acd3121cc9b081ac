#pragma once
// Layer 5: fully_shard, FSDP2's per-parameter sharding for torch::nn::Module trees.
//
// A unit is FSDP2's FSDPParamGroup: its parameters are dim-0 shards (padded), gathered by one
// all-gather before each forward and each backward (prefetched in the order the last pass
// ran), freed after (reshard_after_forward), and their gradients reduce-scattered (averaged
// over the group) once per backward, after every call of the unit in that step. Parameters
// that get no gradient in a step (frozen, unused) get none on their shard. The first unit to
// run a forward is a root: it owns the state of every unit under it (the forward order, the
// end-of-backward callback), so two wrapped models in one process train independently.
// A failed step (an exception in forward or backward) is cleaned up at the next forward.
//
// Beyond PyTorch: parameters a unit keeps whole (ignored_params, or a unit whose parameters
// are all ignored) are replicated, and their gradients are averaged over the unit's group in
// the same backward (FSDP2 leaves them unsynchronised), so the replicas stay equal.
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
  // parameters on the meta device mdist::compute_device() (cuda:LOCAL_RANK, or the CPU).
  std::optional<c10::Device> device;
  // Parameters (by identity) that stay whole and replicated on every rank; their gradients
  // are averaged over the group by the unit whose subtree they are found in.
  std::vector<at::Tensor> ignored_params;
  // Gradients are summed over the group and divided by this; empty: the group's size (an
  // average), as FSDP2. Expert parameters sharded over an expert-data-parallel group of dp / ep
  // ranks take dp (PyTorch: FSDPModule.set_gradient_divide_factor): the expert-parallel
  // all-to-all has already summed the gradients of the ep ranks' tokens. Applied on a group of
  // one rank too. Must be positive and finite.
  std::optional<double> gradient_divide_factor;
};

// What one unit's collectives moved and how long this rank was blocked waiting for them,
// since wrapping or the last reset_communication(): the input of a per-phase profile
// (bench/fsdp_train.sh). Bytes are the collectives' full buffers (world x this rank's padded
// chunk); a ring algorithm puts (world - 1) / world of them on each rank's wire. One rank
// communicates nothing.
struct FsdpCommStats {
  int64_t all_gathers = 0;
  int64_t all_gather_bytes = 0;  // gathered buffers
  int64_t reduce_scatters = 0;
  int64_t reduce_scatter_bytes = 0;  // reduce-scatter inputs (gradients + has-gradient flags)
  int64_t all_reduces = 0;
  int64_t all_reduce_bytes = 0;  // replicated parameters' gradients (+ flags)
  // Blocked in wait() on any of them: the communication not hidden behind compute.
  double wait_s = 0;
};

namespace detail {
class FsdpParamGroup;
}

// A wrapped module's FSDP state. Copies refer to the same unit.
class FsdpHandle {
 public:
  explicit FsdpHandle(std::shared_ptr<detail::FsdpParamGroup> unit) : unit_(std::move(unit)) {}

  // Gathers the full parameters now (the forward pre-hook does this on its own).
  void unshard();
  // Frees the full parameters' storage, keeping the shards (and drops a prefetched gather).
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
  // Names (relative to the wrapped module) of the parameters this unit shards; a tied
  // parameter is managed once, under the first name it is registered with.
  std::vector<std::string> managed_parameter_names() const;
  // Names of the parameters it keeps whole and replicated (ignored_params under it).
  std::vector<std::string> replicated_parameter_names() const;
  // Shapes of one managed parameter: before sharding, and of this rank's shard.
  std::vector<int64_t> full_shape(const std::string& name) const;
  std::vector<int64_t> shard_shape(const std::string& name) const;
  // This unit's communication so far (see FsdpCommStats), and starting it again from zero.
  FsdpCommStats communication() const;
  void reset_communication();

 private:
  std::shared_ptr<detail::FsdpParamGroup> unit_;
};

// Shards every parameter under `module` that no nested unit manages and that is not
// ignored, along dim 0 over the group. Afterwards module.parameters() yields the shards
// (what an optimizer steps). Wrap inner modules first, then their parents. A parameter
// registered under several names (tied weights) is one shard, registered under all of them.
// Parameters on the meta device (a model built without storage, see mdist/nn/meta.h) are
// accepted: each rank allocates only its shard (zeros, to be filled e.g. by
// load_state_dict_by_rows) and the full parameters get memory only when gathered. Ignored
// meta parameters stay on meta (mdist::nn::to_empty materialises them).
// Throws Error for a module without parameters (outside nested units), a module wrapped
// twice, a module whose parameters a unit already manages (wrapped after its parent), a 0-row
// parameter, and mixed dtypes among the sharded parameters of one unit (naming them).
FsdpHandle fully_shard(torch::nn::Module& module, const FullyShardOptions& options = {});

// The handle of a wrapped module; empty when `module` was not wrapped.
std::optional<FsdpHandle> fsdp_handle(const torch::nn::Module& module);

// True if `module` or any submodule has been wrapped by fully_shard.
bool is_fsdp2_model(const torch::nn::Module& module);

}  // namespace mdist
