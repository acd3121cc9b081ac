#pragma once
// Private: the state of one fully_shard unit and the communication it does.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/nn/hooks.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace mdist::detail {

// One parameter managed by a unit.
struct ManagedParam {
  std::string name;  // relative to the unit's module, e.g. "fc1.weight"
  torch::nn::Module* owner = nullptr;
  std::string key;       // its name in owner's parameter table
  at::Tensor unsharded;  // the module's own tensor: full shape, storage freed when resharded
  at::Tensor shard;      // this rank's rows, padded: what parameters() yields
  std::vector<int64_t> full_shape;
  int64_t rows = 0;        // full dim 0 (1 for a 0-d parameter)
  int64_t chunk_rows = 0;  // ceil(rows / W)
  int64_t row_numel = 0;   // elements per row
  int64_t offset = 0;      // start in the unit's per-rank flat buffer
  int64_t shard_numel() const { return chunk_rows * row_numel; }
};

struct FsdpUnit : std::enable_shared_from_this<FsdpUnit> {
  int64_t id = 0;
  torch::nn::Module* module = nullptr;
  std::weak_ptr<const torch::nn::Module> owner;  // expired once the module is gone
  bool owner_tracked = false;
  FullyShardOptions options;
  int world = 1;
  int rank = 0;
  std::vector<ManagedParam> params;
  int64_t flat_numel = 0;
  c10::ScalarType shard_dtype = c10::kFloat;
  c10::ScalarType compute_dtype = c10::kFloat;
  c10::ScalarType reduce_dtype = c10::kFloat;
  c10::Device compute_device = c10::Device(c10::kCPU);  // full parameters, collectives
  c10::Device shard_device = c10::Device(c10::kCPU);    // shards and their gradients
  bool unsharded = false;
  bool requires_gradient_sync = true;
  bool reshard_after_backward = true;
  bool backward_pending = false;  // a forward with grad ran and its post-backward has not
  // Prefetch: the units that ran just after / before this one in the first forward pass.
  std::weak_ptr<FsdpUnit> next_in_forward;
  std::weak_ptr<FsdpUnit> previous_in_forward;
  // An all-gather in flight: its work, its input (kept alive until done) and its output.
  c10::intrusive_ptr<c10d::Work> gather_work;
  at::Tensor gather_input;
  at::Tensor gather_output;
  bool gather_started = false;
  nn::HookHandle pre_hook;
  nn::HookHandle post_hook;

  // Issues the all-gather of the full parameters without waiting for it (prefetch).
  void start_unshard();
  // Completes the gather (issuing it first if needed) and fills the full parameters.
  void unshard();
  void reshard();
  // The full parameters gathered from the shards in the shards' dtype, into new tensors (the
  // unit's own full parameters are left as they are). Collective over the unit's group.
  std::vector<at::Tensor> gather_full_parameters(const c10::Device& device) const;
  void post_backward();
  void reduce_scatter_gradients();
};

// One managed parameter, found by the tensor that parameters() yields for it.
struct ManagedRef {
  std::shared_ptr<FsdpUnit> unit;
  std::size_t index = 0;
  ManagedParam& param() const { return unit->params[index]; }
};
std::optional<ManagedRef> find_managed(const at::Tensor& registered);

// Rank `rank`'s rows [first, first + count) of a parameter with `chunk_rows` rows per rank.
struct OwnedRows {
  int64_t first = 0;
  int64_t count = 0;
};
inline OwnedRows owned_rows(const ManagedParam& p, int rank) {
  const int64_t first = rank * p.chunk_rows;
  return {first, std::max<int64_t>(0, std::min(p.chunk_rows, p.rows - first))};
}

}  // namespace mdist::detail
