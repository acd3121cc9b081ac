// Tensor-parallel Linear and Embedding: in place through forward hooks, or as modules.
#include "mdist/tp/layers.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <cmath>
#include <memory>
#include <string>

#include "mdist/error.h"
#include "mdist/nn/hooks.h"
#include "mdist/nn/meta.h"
#include "mdist/runtime/runtime.h"
#include "mdist/tp/collectives.h"

namespace mdist::tp {
namespace {

// Replaces `param`'s values by `part` of them (dim `dim`), keeping the TensorImpl (the
// module's member and its parameter table entry stay one tensor) and requires_grad.
void cut(at::Tensor& param, int64_t dim, RowRange part) {
  const at::NoGradGuard no_grad;
  if (param.is_meta()) {
    std::vector<int64_t> shape = param.sizes().vec();
    shape[static_cast<std::size_t>(dim)] = part.count;
    nn::assign_in_place(param, at::empty(shape, param.options()));
  } else {
    param.set_data(param.detach().narrow(dim, part.first, part.count).clone());
  }
}

void check_not_split(const at::Tensor& weight, const char* op) {
  if (!weight.defined())
    throw Error(std::string("mdist::tp::") + op + ": the module has no weight");
}

// The ids this rank's rows hold, shifted to local rows (0 elsewhere), and the mask of the rest.
std::pair<at::Tensor, at::Tensor> local_ids(const at::Tensor& ids, int64_t start, int64_t count,
                                            int64_t vocab) {
  if (ids.numel() > 0) {
    const auto [lo, hi] = at::aminmax(ids);
    const int64_t low = lo.item<int64_t>(), high = hi.item<int64_t>();
    if (low < 0 || high >= vocab) {
      throw Error("mdist::tp: vocab-parallel embedding: index " +
                  std::to_string(low < 0 ? low : high) + " is out of range for a vocabulary of " +
                  std::to_string(vocab));
    }
  }
  const at::Tensor outside = ids.lt(start).logical_or(ids.ge(start + count));
  return {(ids - start).masked_fill(outside, 0), outside};
}

at::Tensor masked_reduce(const at::Tensor& looked_up, const at::Tensor& outside, const Group& group,
                         const Counters& counters) {
  return reduce_from_group(looked_up.masked_fill(outside.unsqueeze(-1), 0), group, counters);
}

}  // namespace

void keep_rows(at::Tensor& param, const std::vector<RowRange>& pieces) {
  if (pieces.size() == 1) return cut(param, 0, pieces.front());
  const at::NoGradGuard no_grad;
  int64_t rows = 0;
  for (const RowRange& piece : pieces) rows += piece.count;
  if (param.is_meta()) {
    std::vector<int64_t> shape = param.sizes().vec();
    shape[0] = rows;
    nn::assign_in_place(param, at::empty(shape, param.options()));
    return;
  }
  std::vector<at::Tensor> parts;
  for (const RowRange& piece : pieces) {
    parts.push_back(param.detach().narrow(0, piece.first, piece.count));
  }
  param.set_data(at::cat(parts, 0));
}

// This rank's even share of `size` rows over `group`.
RowRange even_part(int64_t size, const Group& group, const char* what) {
  if (!group.is_not_used() && !group.is_member()) {
    // size() and rank() are -1 there (torch's convention); nothing can be split over it.
    throw Error(std::string("mdist::tp: cannot split ") + what + " over " + group.name() +
                ": this rank is not a member of it");
  }
  const int parts = mdist::size(group);
  const int rank = mdist::rank(group);
  if (parts <= 0 || size % parts != 0) {
    throw Error(std::string("mdist::tp: ") + what + " (" + std::to_string(size) +
                ") does not divide by the tensor-parallel size " + std::to_string(parts));
  }
  const int64_t each = size / parts;
  return {rank * each, each};
}

void parallelize_column(torch::nn::LinearImpl& linear, const Group& group,
                        const ColumnParallelOptions& options) {
  check_not_split(linear.weight, "parallelize_column");
  const int64_t out = linear.weight.size(0);
  // Not value_or: the even split need not exist when the rows are given.
  std::vector<RowRange> pieces = options.row_pieces;
  if (pieces.empty()) {
    pieces.push_back(options.rows ? *options.rows : even_part(out, group, "the output features"));
  }
  int64_t kept = 0;
  for (const RowRange& rows : pieces) {
    if (rows.first < 0 || rows.count <= 0 || rows.first + rows.count > out) {
      throw Error("mdist::tp::parallelize_column: rows [" + std::to_string(rows.first) + ", " +
                  std::to_string(rows.first + rows.count) + ") are not within the " +
                  std::to_string(out) + " output features");
    }
    kept += rows.count;
  }
  keep_rows(linear.weight, pieces);
  if (linear.bias.defined()) keep_rows(linear.bias, pieces);
  linear.options.out_features(kept);
  const Counters counters = options.counters;
  if (options.copy_input) {
    nn::register_forward_pre_hook(
        linear, [group, counters](torch::nn::Module&, nn::TensorRefs& inputs) {
          if (!inputs.empty()) *inputs.front() = copy_to_group(*inputs.front(), group, counters);
        });
  }
  if (options.gather_output) {
    nn::register_forward_hook(
        linear, [group, counters](torch::nn::Module&, nn::TensorRefs& outputs) {
          if (!outputs.empty()) {
            *outputs.front() = gather_from_group(*outputs.front(), group, -1, counters);
          }
        });
  }
}

void parallelize_row(torch::nn::LinearImpl& linear, const Group& group, const Counters& counters) {
  check_not_split(linear.weight, "parallelize_row");
  const RowRange columns = even_part(linear.weight.size(1), group, "the input features");
  cut(linear.weight, 1, columns);
  linear.options.in_features(columns.count);
  if (!linear.bias.defined()) {
    nn::register_forward_hook(
        linear, [group, counters](torch::nn::Module&, nn::TensorRefs& outputs) {
          if (!outputs.empty()) {
            *outputs.front() = reduce_from_group(*outputs.front(), group, counters);
          }
        });
    return;
  }
  // The bias is taken out of the module for its forward and added after the all-reduce, so it
  // counts once; the member is put back afterwards (also when the forward throws).
  auto held = std::make_shared<at::Tensor>();
  nn::register_forward_pre_hook(linear, [held](torch::nn::Module& module, nn::TensorRefs&) {
    auto& self = static_cast<torch::nn::LinearImpl&>(module);
    *held = self.bias;
    self.bias = at::Tensor();
  });
  nn::register_forward_hook(
      linear, [held, group, counters](torch::nn::Module& module, nn::TensorRefs& outputs) {
        auto& self = static_cast<torch::nn::LinearImpl&>(module);
        self.bias = *held;
        held->reset();
        if (outputs.empty()) return;
        *outputs.front() = reduce_from_group(*outputs.front(), group, counters) + self.bias;
      });
  nn::register_forward_error_hook(linear, [held](torch::nn::Module& module) {
    auto& self = static_cast<torch::nn::LinearImpl&>(module);
    if (held->defined()) self.bias = *held;
    held->reset();
  });
}

void parallelize_vocab_embedding(torch::nn::EmbeddingImpl& embedding, const Group& group,
                                 const Counters& counters) {
  check_not_split(embedding.weight, "parallelize_vocab_embedding");
  const int64_t vocab = embedding.weight.size(0);
  const RowRange rows = even_part(vocab, group, "the vocabulary size");
  cut(embedding.weight, 0, rows);
  embedding.options.num_embeddings(rows.count);
  // padding_idx (no gradient for that row) applies on the rank that holds it, at its local row.
  if (const auto pad = embedding.options.padding_idx()) {
    const int64_t global = *pad < 0 ? *pad + vocab : *pad;
    if (global >= rows.first && global < rows.first + rows.count) {
      embedding.options.padding_idx(global - rows.first);
    } else {
      embedding.options.padding_idx(std::nullopt);
    }
  }
  auto outside = std::make_shared<at::Tensor>();
  nn::register_forward_pre_hook(
      embedding, [outside, rows, vocab](torch::nn::Module&, nn::TensorRefs& inputs) {
        if (inputs.empty()) return;
        auto [ids, mask] = local_ids(*inputs.front(), rows.first, rows.count, vocab);
        *inputs.front() = std::move(ids);
        *outside = std::move(mask);
      });
  nn::register_forward_hook(
      embedding, [outside, group, counters](torch::nn::Module&, nn::TensorRefs& outputs) {
        if (outputs.empty()) return;
        *outputs.front() = masked_reduce(*outputs.front(), *outside, group, counters);
        outside->reset();
      });
  nn::register_forward_error_hook(embedding, [outside](torch::nn::Module&) { outside->reset(); });
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in_features, int64_t out_features,
                                                   Group group_, bool with_bias,
                                                   bool gather_output_)
    : group(std::move(group_)), gather_output(gather_output_) {
  const RowRange rows = even_part(out_features, group, "the output features");
  // torch::nn::Linear's initialisation of the full layer: U(-1/sqrt(in), 1/sqrt(in)).
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  weight =
      register_parameter("weight", at::empty({rows.count, in_features}).uniform_(-bound, bound));
  if (with_bias) bias = register_parameter("bias", at::empty({rows.count}).uniform_(-bound, bound));
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  const at::Tensor out = at::linear(copy_to_group(input, group, counters), weight, bias);
  return gather_output ? gather_from_group(out, group, -1, counters) : out;
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in_features, int64_t out_features,
                                             Group group_, bool with_bias, bool input_is_parallel_)
    : group(std::move(group_)), input_is_parallel(input_is_parallel_) {
  const RowRange columns = even_part(in_features, group, "the input features");
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  weight = register_parameter("weight",
                              at::empty({out_features, columns.count}).uniform_(-bound, bound));
  if (with_bias)
    bias = register_parameter("bias", at::empty({out_features}).uniform_(-bound, bound));
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  const at::Tensor x = input_is_parallel ? input : scatter_to_group(input, group, -1, counters);
  const at::Tensor out = reduce_from_group(at::linear(x, weight), group, counters);
  return bias.defined() ? out + bias : out;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t num_embeddings_,
                                                       int64_t embedding_dim, Group group_)
    : group(std::move(group_)), num_embeddings(num_embeddings_) {
  const RowRange rows = even_part(num_embeddings, group, "the vocabulary size");
  vocab_start = rows.first;
  weight = register_parameter("weight", at::empty({rows.count, embedding_dim}).normal_());
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  const auto [local, outside] = local_ids(ids, vocab_start, weight.size(0), num_embeddings);
  return masked_reduce(at::embedding(weight, local), outside, group, counters);
}

}  // namespace mdist::tp
