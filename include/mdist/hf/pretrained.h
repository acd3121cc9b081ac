#pragma once
// Saving and loading a whole Hugging Face checkpoint directory: config.json plus safetensors
// (one file, or shards with model.safetensors.index.json above a size), the layout
// transformers' save_pretrained writes and from_pretrained reads.
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/groups/parallel_state.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/hf/parallelize.h"

namespace mdist::hf {

// The parameters of `model` (wrapped by fully_shard or not, split as `parallelism` says or
// not) whole, in the HF layout, on rank 0 (the other ranks get nothing or a part, not to be
// used). What save_pretrained writes, gathered the same way: collective, every rank calls it;
// under expert parallelism rank 0 collects the other ranks' experts one tensor at a time.
std::map<std::string, at::Tensor> whole_parameters(CausalLM& model, const Parallelism& parallelism);

// Writes `model` (wrapped by fully_shard or not, split as `parallelism` says or not) to `dir`
// in the ordinary HF layout. A sharded or split model is gathered first: collective, every
// rank calls it; rank 0 writes, and under expert parallelism collects the other ranks' experts
// one tensor at a time (the other ranks never hold more than their own). Every file is written
// atomically.
void save_pretrained(CausalLM& model, const Parallelism& parallelism,
                     const std::filesystem::path& dir,
                     std::uint64_t max_shard_bytes = std::uint64_t{5} << 30);
// The same for a model that is not split (an Error if it is: its plans are needed).
void save_pretrained(CausalLM& model, const std::filesystem::path& dir,
                     std::uint64_t max_shard_bytes = std::uint64_t{5} << 30);

class SafetensorsCheckpoint;

// Checks a checkpoint against the model `config` describes before any value is read, as
// transformers' from_pretrained does: every parameter present with exactly the model's (full,
// unsplit) shape ("size mismatch for 'K': copying a param with shape [..] from checkpoint, the
// shape in current model is [..]"), stored in a floating-point dtype (converted to the
// model's on load; an integer or bool tensor is refused), and a tied model's lm_head.weight
// copy equal in shape to the embedding. Keys the model does not have are not an error (as in
// transformers, which ignores them: old Llama checkpoints carry rotary_emb.inv_freq); they are
// returned, for the caller to report. Throws Error naming the first problems.
std::vector<std::string> check_checkpoint(const LlamaConfig& config,
                                          const SafetensorsCheckpoint& checkpoint);

// Builds the model from dir/config.json and loads its weights by name.
CausalLM load_pretrained(const std::filesystem::path& dir);

// Loads dir's weights into `model` that is already wrapped (fsdp2_wrap / fully_shard): each
// rank reads only the rows it owns straight from the memory-mapped safetensors files, so no
// rank holds a full copy of the sharded weights; the mapped pages of each tensor are released
// once its rows are copied, so the file does not add up in the rank's memory either. Also
// works on an unwrapped model; throws Error if a parameter is still on the meta device. A
// CausalLM whose experts are split reads only its own experts.
void load_checkpoint_sharded(torch::nn::Module& model, const std::filesystem::path& dir);
// The same for a CausalLM split as `parallelism` says: under tensor parallelism each rank reads
// only its slice (and within it its own rows).
void load_checkpoint_sharded(CausalLM& model, const Parallelism& parallelism,
                             const std::filesystem::path& dir);

// fsdp2_wrap's arguments, for load_pretrained_fsdp2.
struct Fsdp2LoadOptions {
  bool shard_root = true;
  std::optional<MixedPrecisionPolicy> mp_policy = std::nullopt;
  bool cpu_offload = false;
  // The layout (default: data parallel over the world), applied by hf::apply_parallelism:
  // fsdp2_wrap shards over its data-parallel group; with a tensor-parallel group of more than
  // one rank, hf::parallelize splits the model over it first and each rank reads only its
  // slice's own rows.
  ParallelState parallel = ParallelState();
  // With an expert-parallel group of more than one rank in `parallel`: the ranks holding the
  // same experts (mdist::make_expert_data_parallel_group); each rank keeps and reads only its
  // own experts (hf::parallelize_experts, hf::shard_experts). Required then, as every group
  // is made collectively by the caller, never inside the load.
  std::optional<Group> expert_data_parallel = std::nullopt;
};

// Builds the model from dir/config.json on the meta device, splits and wraps it
// (hf::apply_parallelism), then each rank reads only its rows from the mmap'd safetensors.
// Returns the model with its Parallelism.
// The result equals load_pretrained(dir) followed by fsdp2_wrap with the same options, but no
// rank ever allocates the whole model: each holds its shards (plus, without shard_root, the
// root's whole parameters) and touches only the checkpoint pages of its own rows.
// Collective: every rank of the world calls it; if any rank fails (a missing file, a shape
// mismatch), every rank throws (the failing ones their own error), so none is left waiting
// in a collective of its first forward.
ParallelModel load_pretrained_fsdp2(const std::filesystem::path& dir,
                                    const Fsdp2LoadOptions& options = {});

}  // namespace mdist::hf
