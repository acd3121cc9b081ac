#pragma once
// Tensor-parallel layers (Megatron's), in two forms that share the collectives of
// mdist/tp/collectives.h:
//
// - In place on a model's own modules: parallelize_column / parallelize_row /
//   parallelize_vocab_embedding cut a torch::nn::Linear or Embedding down to this rank's part
//   and put the collectives in its forward hooks. The module keeps its type and its parameter
//   names (code that looks for every torch::nn::Linear still finds it, a checkpoint key still
//   names it), so its parent must call it through mdist::nn::call (mdist/nn/hooks.h), as
//   mdist::hf::CausalLM does. Do it before fully_shard / fsdp2_wrap; on the meta device too
//   (the cut parameter stays on meta, with the local shape).
// - Modules of their own (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
//   for models written with them, whose forward runs the collectives itself.
//
// The split is even: the split dimension must divide by the group size (an Error names the
// sizes otherwise). Group rank r holds the r-th part.
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "mdist/runtime/group.h"
#include "mdist/tp/collectives.h"

namespace mdist::tp {

// Rows [first, first + count) of a tensor's dim 0.
struct RowRange {
  int64_t first = 0;
  int64_t count = 0;
};

struct ColumnParallelOptions {
  // Concatenate the outputs over the group (every rank then has the full output).
  bool gather_output = false;
  // Pass the input through copy_to_group (all-reduce of its gradient). Off when the caller
  // does that once for several layers reading the same input, or when the input's gradient
  // is not needed.
  bool copy_input = true;
  // The output rows (dim 0 of the weight) this rank keeps; default: the even split. For a
  // layer replicated on several ranks (KV heads shared by ranks), give the same rows to each
  // and sum their gradients with sum_gradients_over over the ranks that share them.
  std::optional<RowRange> rows = std::nullopt;
  // Several row ranges instead, kept in this order (a fused projection whose rows are parts
  // split separately, as Phi-3's qkv_proj: this rank's query, key and value heads); overrides
  // `rows` when not empty.
  std::vector<RowRange> row_pieces = {};
  // Where its collectives are counted (the plan the layer belongs to); null: nowhere.
  Counters counters = nullptr;
};

// Column-parallel: weight [out, in] -> its output rows, bias likewise; forward is
// x -> copy_to_group(x) -> linear (-> gather_from_group over the last dim).
void parallelize_column(torch::nn::LinearImpl& linear, const Group& group,
                        const ColumnParallelOptions& options = {});
// Row-parallel: weight [out, in] -> its input columns (the input must be this rank's part of
// the features, e.g. a column-parallel layer's output); forward is
// linear without bias -> reduce_from_group -> + bias, so the bias is added once. The bias
// stays whole (replicated).
void parallelize_row(torch::nn::LinearImpl& linear, const Group& group,
                     const Counters& counters = nullptr);
// Vocab-parallel: weight [V, D] -> its rows [r V / T, (r + 1) V / T); forward looks up the
// ids this rank holds, zeros the others and all-reduces. An id outside [0, V) is an Error on
// every rank, as torch's embedding refuses it. padding_idx keeps its meaning (no gradient).
void parallelize_vocab_embedding(torch::nn::EmbeddingImpl& embedding, const Group& group,
                                 const Counters& counters = nullptr);

// Replaces `param`'s values by its rows (dim 0) `pieces`, concatenated in order, keeping the
// TensorImpl and requires_grad (on the meta device: the shape only). For a parameter split
// with no layer of its own (a norm weight over split features).
void keep_rows(at::Tensor& param, const std::vector<RowRange>& pieces);

// Rank r's part of `size` split over `parts`: [r * size / parts, (r + 1) * size / parts);
// Error naming `what` when it does not divide.
RowRange even_part(int64_t size, int parts, int rank, const char* what);

struct ColumnParallelLinearImpl : torch::nn::Module {
  // Full sizes; this rank holds out_features / T output rows. Initialised as torch::nn::Linear
  // initialises the full layer's rows (same seed, same values as the unsplit layer's slice).
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features, Group group, bool bias = true,
                           bool gather_output = false);
  at::Tensor forward(const at::Tensor& input);
  at::Tensor weight, bias;
  Group group;
  bool gather_output;
  Counters counters = std::make_shared<CommCounters>();  // this module's collectives
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelLinearImpl : torch::nn::Module {
  // Full sizes; this rank holds in_features / T input columns. input_is_parallel: the input
  // is already this rank's features (else it is split here with scatter_to_group).
  RowParallelLinearImpl(int64_t in_features, int64_t out_features, Group group, bool bias = true,
                        bool input_is_parallel = true);
  at::Tensor forward(const at::Tensor& input);
  at::Tensor weight, bias;
  Group group;
  bool input_is_parallel;
  Counters counters = std::make_shared<CommCounters>();  // this module's collectives
};
TORCH_MODULE(RowParallelLinear);

struct VocabParallelEmbeddingImpl : torch::nn::Module {
  // Initialised as torch::nn::Embedding initialises the full table's rows (normal(0, 1)).
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim, Group group);
  at::Tensor forward(const at::Tensor& ids);
  at::Tensor weight;
  Group group;
  int64_t num_embeddings;
  int64_t vocab_start;
  Counters counters = std::make_shared<CommCounters>();  // this module's collectives
};
TORCH_MODULE(VocabParallelEmbedding);

}  // namespace mdist::tp
