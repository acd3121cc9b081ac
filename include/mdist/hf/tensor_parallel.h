#pragma once
// Megatron-style tensor parallelism for the Llama family (mdist::hf::CausalLM): the plan that
// splits a model over a ParallelState's tensor-parallel group, as torchtitan keeps the model
// apart from its parallelisation. parallelize() cuts the model's own modules in place
// (mdist/tp/layers.h), so the model keeps its type, its module tree and its HF parameter names:
//
//   q_proj, k_proj, v_proj, gate_proj, up_proj   column-parallel (heads / intermediate split)
//   o_proj, down_proj                            row-parallel (bias added once, replicated)
//   embed_tokens                                 vocab-parallel (rows split)
//   lm_head                                      column-parallel over the vocabulary, not
//                                                gathered: forward returns this rank's logits
//                                                [B, T, V / T]; loss() never builds the full
//                                                logits. A tied head uses the split embedding.
//   norms (and Qwen3's q/k norms)                replicated
//
// Heads split evenly: T must divide num_attention_heads; num_key_value_heads must divide by T,
// or (fewer KV heads than ranks) divide T, in which case each KV head is replicated on the
// T / kv ranks whose query heads use it (as Megatron-style inference engines do) and its
// gradient is summed over those ranks. intermediate_size and vocab_size must divide by T. A
// split that cannot work is one Error naming the sizes.
//
// Compose with data parallelism by wrapping afterwards: fsdp2_wrap(model, ..., state's
// data-parallel group) shards the tensor-parallel parameters over the data-parallel group;
// hf::apply_parallelism (mdist/hf/parallelize.h) does both. The plan is held beside the model,
// not in it: the loss, the full logits, saving and loading of a split model take it.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mdist/fsdp/state_dict.h"
#include "mdist/groups/parallel_state.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/tp/collectives.h"
#include "mdist/tp/layers.h"

namespace mdist::hf {

// How one parameter (by its HF name) is split over the tensor-parallel group on this rank.
struct TensorParallelPlacement {
  enum class Split { kReplicated, kRows, kColumns };
  Split split = Split::kReplicated;
  int64_t offset = 0;  // first row (kRows) or column (kColumns) of the full tensor held
  int64_t length = 0;  // how many
  std::vector<int64_t> full_shape;
  // This rank holds the first copy of these values among the ranks that hold them: it writes
  // them and counts them in a global norm. Every rank for a split tensor; tensor-parallel
  // rank 0 for a replicated one; the first of the ranks sharing a replicated KV head.
  bool primary = true;
  // kRows of a fused weight (Phi-3's qkv_proj and gate_up_proj, whose parts split
  // separately): the full tensor's row ranges this rank holds, in its local order; `offset` is
  // then the first range's and `length` their total. Empty: the one range [offset, offset +
  // length).
  std::vector<tp::RowRange> pieces;
  // The shape this rank's tensor has.
  std::vector<int64_t> local_shape() const;
  // kRows: the full tensor's row ranges this rank holds, in local order.
  std::vector<tp::RowRange> row_ranges() const;
  // kRows: local rows [first, first + count) as ranges of the full tensor's rows.
  std::vector<tp::RowRange> full_rows_of(int64_t first, int64_t count) const;
  // This rank's part of a tensor of the full shape (rows or columns as placed; a replicated
  // tensor as it is).
  at::Tensor local_part(const at::Tensor& full) const;
};

class TensorParallelPlan {
 public:
  // `counters`: where the split model's collectives are counted (parallelize gives the
  // model's layers the same); null: a new one.
  TensorParallelPlan(Group group, int64_t vocab_size,
                     std::map<std::string, TensorParallelPlacement> placements,
                     bool holds_global_rank0, tp::Counters counters = nullptr);

  const Group& group() const { return group_; }
  int size() const;
  int rank() const;
  // The first global token id of this rank's logits and embedding rows.
  int64_t vocab_start() const { return vocab_start_; }
  const std::map<std::string, TensorParallelPlacement>& placements() const { return placements_; }
  // The placement of `name`, or a replicated one for a name the plan does not split.
  TensorParallelPlacement placement(const std::string& name) const;

  // HF's causal-LM loss from this rank's logits [B, T, V / T] (vocab-parallel cross entropy).
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& labels) const;
  // Gathers logits [..., V / T] into [..., V] (autograd-aware). For a few positions (the last
  // one when generating); the loss does not need it.
  at::Tensor full_logits(const at::Tensor& logits) const;

  // A checkpoint in the HF layout read as this rank's tensors: shapes are local, and rows or
  // columns come from the full tensor's slice (columns read a bounded number of full rows at
  // a time). For load_state_dict_by_rows, also under fully_shard.
  RowSource local_source(RowSource full) const;
  // Collective over the tensor-parallel group: whole HF-layout tensors from every rank's
  // local ones (same keys on every rank). Only the group holding global rank 0 needs to call
  // it (holds_global_rank0); its rank 0 gets the result, the others an empty map.
  std::map<std::string, at::Tensor> gather(const std::map<std::string, at::Tensor>& local) const;
  bool holds_global_rank0() const { return holds_global_rank0_; }

  // The bytes the split model's tensor-parallel collectives (its layers' hooks, loss() and
  // full_logits()) have moved since the split or the last reset: this plan's own counters.
  tp::CommunicationBytes communication() const { return counters_->bytes(); }
  void reset_communication() const { counters_->reset(); }
  const tp::Counters& counters() const { return counters_; }

 private:
  Group group_;
  int64_t vocab_start_ = 0;
  std::map<std::string, TensorParallelPlacement> placements_;
  bool holds_global_rank0_ = true;
  tp::Counters counters_;
};

// Checks that `config` splits over `tensor_parallel` ranks; throws Error naming the sizes.
void check_tensor_parallel_split(const LlamaConfig& config, int tensor_parallel);

// Splits `model` over state.tensor_parallel_group and returns the plan (keep it: the loss,
// full logits, saving and loading of the split model need it). A tensor-parallel group that is
// "not used" or of one rank leaves the model as it is (a plan of size 1). Collective over the
// world when KV heads are replicated (it makes the groups of ranks that share one); call it on
// every rank, before fsdp2_wrap. The model may be on the meta device (its parameters get their
// local shapes). Throws Error for a model already split or wrapped.
std::shared_ptr<const TensorParallelPlan> parallelize(CausalLM& model, const ParallelState& state);

// Whether `model`'s modules have been cut by parallelize (its embedding holds fewer rows than
// the vocabulary): such a model must not be saved, loaded or clipped without its plan.
bool is_tensor_parallel_split(const CausalLM& model);

}  // namespace mdist::hf
