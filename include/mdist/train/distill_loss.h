#pragma once
// Knowledge distillation's loss on logits, as modelopt's QAD computes it
// (modelopt.torch.distill.LogitsDistillationLoss with reduction "none", reduced by its
// Hugging Face plugin's _standard_kd_loss):
//   per token:  T^2 * KL(softmax(t / T) || softmax(s / T))
//             = T^2 * sum_v softmax(t / T)_v * (log_softmax(t / T)_v - log_softmax(s / T)_v)
//   reduced:    sum over the tokens whose label is not ignored / max(their count, 1)
// (0, not NaN, when every label is ignored, as modelopt's clamp gives). The teacher's logits
// `t` are a constant: only the student's `s` get a gradient, T * (softmax(s / T) -
// softmax(t / T)) per token times its weight. The forward computes in fp32 whatever the logits'
// dtype (modelopt casts both to float) and the backward keeps only that [N, V] difference: no
// teacher logits outlive the call.
//
// The vocab-parallel form takes each rank's columns of both logits (the same vocabulary split
// for the student and the teacher); the row maxima and the sums of exponentials and of the
// per-token divergence come from three all-reduces over the tensor-parallel group, the backward
// is local. No rank holds more than its own columns.
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "mdist/hf/parallelize.h"
#include "mdist/runtime/group.h"
#include "mdist/tp/collectives.h"

namespace mdist::train {

// student, teacher [N, V] (same shape), labels [N]. Error for mismatched shapes or a
// temperature that is not a finite positive number.
at::Tensor logits_distillation_loss(const at::Tensor& student, const at::Tensor& teacher,
                                    const at::Tensor& labels, double temperature,
                                    std::int64_t ignore_index = -100);

// The same on this rank's vocabulary columns [N, V / T] of both logits; the same value on
// every rank of `group`. Collective over `group`.
at::Tensor vocab_parallel_logits_distillation_loss(const at::Tensor& student,
                                                   const at::Tensor& teacher,
                                                   const at::Tensor& labels, double temperature,
                                                   const Group& group,
                                                   std::int64_t ignore_index = -100,
                                                   const tp::Counters& counters = nullptr);

// A causal LM's distillation loss: logits [B, T, V] (this rank's columns when `parallelism`
// splits the vocabulary) at position t against the label at t + 1 (-100 ignored), as modelopt
// shifts them; vocab-parallel when the vocabulary is split.
at::Tensor causal_lm_distillation_loss(const hf::Parallelism& parallelism,
                                       const at::Tensor& student, const at::Tensor& teacher,
                                       const at::Tensor& labels, double temperature);

}  // namespace mdist::train
