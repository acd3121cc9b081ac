// Vocab-parallel cross entropy: the softmax's normaliser and the target logit come from two
// all-reduces over the tensor-parallel group; the gradient is computed locally.
#include "mdist/tp/cross_entropy.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <sstream>
#include <string>

#include "mdist/error.h"
#include "mdist/runtime/runtime.h"
#include "mdist/tp/collectives.h"

namespace mdist::tp {
namespace {

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

// d loss / d logits = (softmax - one_hot) * (valid / count), on this rank's columns.
struct VocabParallelCrossEntropyBackward : torch::autograd::Node {
  at::Tensor softmax;       // [N, Vl] fp32
  at::Tensor local_target;  // [N] int64 column on this rank, 0 where not on it
  at::Tensor on_rank;       // [N] bool: the target is one of this rank's columns (and valid)
  at::Tensor weight;        // [N] fp32: 1 / count for a valid label, 0 otherwise
  c10::ScalarType dtype = c10::kFloat;
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    at::Tensor grad = softmax.clone();
    const at::Tensor rows = at::arange(grad.size(0), local_target.options());
    grad.index_put_({rows, local_target},
                    grad.index({rows, local_target}) - on_rank.to(at::kFloat));
    grad.mul_((weight * grads[0].to(at::kFloat)).unsqueeze(1));
    return {grad.to(dtype)};
  }
  std::string name() const override { return "mdist::tp::VocabParallelCrossEntropyBackward"; }
};

// The forward of both entry points: per-token losses and what the backward needs.
struct Forward {
  at::Tensor per_token;     // [N] fp32, 0 where ignored
  at::Tensor exp;           // [N, Vl] exp(z - max)
  at::Tensor sum_exp;       // [N]
  at::Tensor local_target;  // [N]
  at::Tensor on_rank;       // [N] bool
  at::Tensor valid;         // [N] bool
};

Forward forward(const at::Tensor& logits, const at::Tensor& labels, const Group& group,
                int64_t vocab_start, int64_t ignore_index, const char* op,
                const Counters& counters) {
  if (logits.dim() != 2 || labels.dim() != 1 || logits.size(0) != labels.size(0)) {
    throw Error(std::string("mdist::tp::") + op + ": logits " + shape_of(logits) + " and labels " +
                shape_of(labels) + " are not [N, V / T] and [N]");
  }
  const at::NoGradGuard no_grad;
  const int64_t local_vocab = logits.size(1);
  const at::Tensor z = logits.detach().to(at::kFloat);
  const at::Tensor target = labels.to(at::kLong).to(logits.device());
  Forward f;
  f.valid = target != ignore_index;
  f.on_rank =
      f.valid.logical_and(target >= vocab_start).logical_and(target < vocab_start + local_vocab);
  const int64_t vocab = local_vocab * size(group);
  if (f.valid.logical_and(target.lt(0).logical_or(target.ge(vocab))).any().item<bool>()) {
    throw Error(std::string("mdist::tp::") + op + ": a label is outside the vocabulary [0, " +
                std::to_string(vocab) + ") and is not the ignore index " +
                std::to_string(ignore_index));
  }
  f.local_target = at::where(f.on_rank, target - vocab_start, at::zeros_like(target));
  // The row maxima over the whole vocabulary, for a stable exponent.
  at::Tensor max = std::get<0>(z.max(1)).contiguous();
  all_reduce_(max, group, "max", counters);
  const at::Tensor shifted = z - max.unsqueeze(1);
  f.exp = shifted.exp();
  // Sum of exponentials and the target's shifted logit (on the rank that has it), in one
  // all-reduce.
  const at::Tensor picked = shifted.gather(1, f.local_target.unsqueeze(1)).squeeze(1);
  at::Tensor packed =
      at::stack({f.exp.sum(1), at::where(f.on_rank, picked, at::zeros_like(picked))}).contiguous();
  all_reduce_(packed, group, "sum", counters);
  f.sum_exp = packed[0];
  // -log softmax[target]
  f.per_token = at::where(f.valid, f.sum_exp.log() - packed[1], at::zeros_like(picked));
  return f;
}

}  // namespace

at::Tensor vocab_parallel_token_losses(const at::Tensor& logits, const at::Tensor& labels,
                                       const Group& group, int64_t vocab_start,
                                       int64_t ignore_index, const Counters& counters) {
  return forward(logits, labels, group, vocab_start, ignore_index, "vocab_parallel_token_losses",
                 counters)
      .per_token;
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                        const Group& group, int64_t vocab_start,
                                        int64_t ignore_index, const Counters& counters) {
  const Forward f = forward(logits, labels, group, vocab_start, ignore_index,
                            "vocab_parallel_cross_entropy", counters);
  // Every label ignored: weight is 0 / 0 and the loss NaN, as torch's mean reduction gives.
  const at::Tensor weight = f.valid.to(at::kFloat) / f.valid.sum().to(at::kFloat);
  at::Tensor loss = (f.per_token * weight).sum();
  if (at::GradMode::is_enabled() && logits.requires_grad()) {
    auto node = c10::make_intrusive<VocabParallelCrossEntropyBackward>();
    node->softmax = f.exp / f.sum_exp.unsqueeze(1);
    node->local_target = f.local_target;
    node->on_rank = f.on_rank;
    node->weight = weight;
    node->dtype = logits.scalar_type();
    node->set_next_edges(torch::autograd::collect_next_edges(logits));
    torch::autograd::impl::set_gradient_edge(
        loss, torch::autograd::Edge(node, node->add_input_metadata(loss)));
  }
  return loss;
}

at::Tensor vocab_parallel_causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels,
                                         const Group& group, int64_t vocab_start,
                                         const Counters& counters) {
  if (logits.dim() != 3 || labels.dim() != 2 || logits.size(0) != labels.size(0) ||
      logits.size(1) != labels.size(1)) {
    throw Error("mdist::tp::vocab_parallel_causal_lm_loss: logits " + shape_of(logits) +
                " and labels " + shape_of(labels) + " are not [B, T, V / T] and [B, T]");
  }
  const int64_t local_vocab = logits.size(2);
  return vocab_parallel_cross_entropy(logits.slice(1, 0, -1).reshape({-1, local_vocab}),
                                      labels.slice(1, 1).reshape({-1}), group, vocab_start, -100,
                                      counters);
}

}  // namespace mdist::tp
