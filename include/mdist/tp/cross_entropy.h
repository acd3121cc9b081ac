#pragma once
// Cross entropy over logits whose vocabulary is split across a tensor-parallel group
// (Megatron's vocab-parallel cross entropy): no rank ever holds more than its own columns.
// Two all-reduces per call (the row maxima, then the sums of exponentials and the target
// logits packed together); the backward is local (softmax minus one-hot on this rank's
// columns).
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "mdist/runtime/group.h"
#include "mdist/tp/collectives.h"

namespace mdist::tp {

// logits [N, V / T] (this rank's columns, the global ids [vocab_start, vocab_start + V / T)),
// labels [N] of global ids in [0, V) or ignore_index. Returns the mean over the labels not
// ignored of -log softmax(full logits)[label], computed in fp32 as at::cross_entropy_loss with
// Reduction::Mean (NaN when every label is ignored, as torch). Same value on every rank.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                        const Group& group, int64_t vocab_start,
                                        int64_t ignore_index = -100,
                                        const Counters& counters = nullptr);

// The per-label losses [N] of the same (0 where a label is ignored), without autograd: for
// sums over many batches (perplexity) that must not depend on how they were grouped.
at::Tensor vocab_parallel_token_losses(const at::Tensor& logits, const at::Tensor& labels,
                                       const Group& group, int64_t vocab_start,
                                       int64_t ignore_index = -100,
                                       const Counters& counters = nullptr);

// Hugging Face's causal-LM loss (logits at t against labels at t + 1, -100 ignored) on
// vocabulary-split logits [B, T, V / T]: hf::causal_lm_loss of the gathered logits.
at::Tensor vocab_parallel_causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels,
                                         const Group& group, int64_t vocab_start,
                                         const Counters& counters = nullptr);

}  // namespace mdist::tp
