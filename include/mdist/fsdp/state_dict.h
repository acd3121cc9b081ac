#pragma once
// State dicts of a model wrapped with fully_shard, keyed by the names parameters have in the
// un-wrapped model ("fc1.weight"). Parameters no unit manages (ignored, or outside every
// unit) and buffers appear whole.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "mdist/runtime/group.h"

namespace mdist {

// This rank's rows of one parameter: rows [row_offset, row_offset + local.size(0)) of a
// tensor of full_shape (padding excluded; a rank past the end holds 0 rows).
struct ShardedTensor {
  at::Tensor local;
  std::vector<int64_t> full_shape;
  int64_t row_offset = 0;
};

// Each rank's own rows, no communication.
std::map<std::string, ShardedTensor> sharded_state_dict(torch::nn::Module& model);
// Loads a dict saved by sharded_state_dict from the same layout (same group size). Units are
// left resharded.
void load_sharded_state_dict(torch::nn::Module& model,
                             const std::map<std::string, ShardedTensor>& state);

struct FullStateDictOptions {
  bool rank0_only = true;  // other ranks get an empty dict
  bool cpu = true;         // gathered tensors on the CPU
  // Whether this rank keeps the dict, overriding rank0_only (e.g. every rank of the
  // tensor-parallel group that holds global rank 0, for hf::TensorParallelPlan::gather).
  std::optional<bool> keep = std::nullopt;
  // When set, a keeping rank's dict holds only the parameters and buffers this accepts (by
  // key); the others are still gathered (the gathers are collective) but dropped at once, so a
  // rank that needs a few tensors (e.g. its experts, hf::save_pretrained under expert
  // parallelism) never holds the rest of the model whole.
  std::function<bool(const std::string& name)> only = nullptr;
};
// Gathers every parameter whole (collective: every rank calls it).
std::map<std::string, at::Tensor> full_state_dict(torch::nn::Module& model,
                                                  const FullStateDictOptions& options = {});
// Loads whole tensors (every rank passes the full dict, e.g. read from one checkpoint);
// each rank keeps its rows, so a dict saved from any group size loads into any other. Units
// are left resharded.
void load_full_state_dict(torch::nn::Module& model, const std::map<std::string, at::Tensor>& state);

// A checkpoint that can be read a few rows at a time (e.g. memory-mapped safetensors).
struct RowSource {
  // Every tensor the checkpoint holds.
  std::function<std::vector<std::string>()> keys;
  // The shape of one of them.
  std::function<std::vector<int64_t>(const std::string& name)> shape;
  // Rows [first_row, first_row + rows) of one, or all of it for rows = -1.
  std::function<at::Tensor(const std::string& name, int64_t first_row, int64_t rows)> read;
};

// Loads every parameter and buffer from `source`, asking for a sharded parameter only the rows
// this rank owns (in calls of about 16 MiB each) and for a whole one all of it: a loader
// backed by memory-mapped files then never holds a full copy of a sharded model. No
// communication. Keys as in full_state_dict. Before anything is loaded, the keys must be
// exactly the model's and every shape must be the model's full shape, as torch's
// load_state_dict checks: an Error names the first missing key ("missing key 'x'"), unexpected
// key ("unexpected key 'x'"), or "size mismatch for 'x': ..." with both shapes. Units are left
// resharded (a gathered copy would be stale).
void load_state_dict_by_rows(torch::nn::Module& model, const RowSource& source);

// Where each parameter of a (possibly wrapped) model lives on this rank, keyed as in
// full_state_dict: `param` is the tensor the model registers, the one an optimizer holds (for
// a sharded parameter this rank's padded shard); rows [row_offset, row_offset + rows) of a
// tensor of full_shape are this rank's, stored in param's first `rows` rows. A parameter no
// unit manages is whole on every rank (sharded = false). For per-parameter state that follows
// the parameter's layout, e.g. an optimizer's moments in a checkpoint.
struct ParamPlacement {
  at::Tensor param;
  std::vector<int64_t> full_shape;
  int64_t row_offset = 0;
  int64_t rows = 0;
  bool sharded = false;
};
std::map<std::string, ParamPlacement> param_placements(torch::nn::Module& model);

// Clips the gradients of a wrapped model by their global norm across ranks and returns that
// norm: shards summed over the group; whole parameters (replicated, their gradients averaged
// by their unit, so the same on every rank) counted once, from rank 0; a tied parameter once.
// One device sync and one collective. norm_type: 2 or infinity.
double clip_grad_norm_(torch::nn::Module& model, double max_norm, double norm_type = 2.0);
// For a model split beyond its units' group (tensor parallelism): `counted(name)` says
// whether this rank's copy of a parameter counts in the norm (false for the copies a
// tensor-parallel replica also holds), and the norm is summed over `group`, which must span
// every rank holding a distinct part (the world for TP x FSDP). A whole parameter of a unit
// counts on its unit group's rank 0; without units, wherever `counted` says. With a scope the
// units may use different groups (expert parallelism: experts sharded over their
// expert-data-parallel group, the rest over data parallel); `counted` alone then says where a
// whole parameter counts.
struct GradNormScope {
  std::function<bool(const std::string& name)> counted;
  Group group = Group::world();
};
double clip_grad_norm_(torch::nn::Module& model, double max_norm, double norm_type,
                       const GradNormScope& scope);

}  // namespace mdist
