// See mdist/train/distillation.h.
#include "mdist/train/distillation.h"

#include <cmath>
#include <string>

#include "mdist/error.h"
#include "mdist/train/distill_loss.h"
#include "src/train/router_aux_loss.h"

namespace mdist::train {

DistillationLoss::DistillationLoss(hf::ParallelModel teacher, const hf::LlamaConfig& student_config,
                                   double aux_weight, DistillationSettings settings)
    : teacher_(std::move(teacher.model)),
      teacher_parallelism_(std::move(teacher.parallelism)),
      moe_(student_config.moe.has_value()),
      aux_weight_(aux_weight),
      settings_(settings) {
  if (teacher_->config.vocab_size != student_config.vocab_size) {
    throw Error("the teacher's vocabulary has " + std::to_string(teacher_->config.vocab_size) +
                " tokens, the student's " + std::to_string(student_config.vocab_size));
  }
  if (!(std::isfinite(settings_.temperature) && settings_.temperature > 0) ||
      !(std::isfinite(settings_.ce_weight) && settings_.ce_weight >= 0)) {
    throw Error(
        "distillation: the temperature must be positive and the cross entropy's weight "
        "non-negative");
  }
  // Eval mode, as modelopt runs it; its forwards run under no-grad (operator()), so none of
  // its parameters ever gets a gradient.
  teacher_->eval();
}

std::int64_t DistillationLoss::predicted_tokens(const Batch& batch) const {
  return train::predicted_tokens(batch);
}

LossParts DistillationLoss::operator()(hf::CausalLM& model, const hf::Parallelism& parallelism,
                                       const at::Tensor& logits, const Batch& batch,
                                       const LossNormalisation& normalisation) {
  // Under tensor parallelism both logits must be the same vocabulary columns: the teacher is
  // split over the student's group (the same vocabulary size splits the same way).
  if (parallelism.tensor_parallel_split() && (!teacher_parallelism_.tensor_parallel_split() ||
                                              teacher_parallelism_.tensor_parallel->vocab_start() !=
                                                  parallelism.tensor_parallel->vocab_start())) {
    throw Error("distillation: the teacher is not split over the student's tensor-parallel group");
  }
  // The teacher's forward on every rank, also one with nothing to predict: its FSDP and
  // tensor-parallel collectives must run on all of them alike.
  at::Tensor teacher_logits;
  {
    const at::NoGradGuard no_grad;
    teacher_logits = teacher_->forward(batch.ids, batch.attention_mask, batch.position_ids);
  }
  LossParts parts;
  parts.tokens = predicted_tokens(batch);
  if (parts.tokens > 0) {
    const at::Tensor& targets = batch.targets();
    const at::Tensor kd = causal_lm_distillation_loss(parallelism, logits, teacher_logits, targets,
                                                      settings_.temperature);
    teacher_logits.reset();  // not kept past the loss (the backward holds only its gradient)
    at::Tensor ce;
    if (settings_.ce_weight > 0) {
      ce = hf::causal_lm_loss(parallelism, logits, targets);
      parts.loss = kd + settings_.ce_weight * ce;
    } else {
      // Measured for the log only: no graph.
      const at::NoGradGuard no_grad;
      ce = hf::causal_lm_loss(parallelism, logits.detach(), targets);
      parts.loss = kd;
    }
    parts.kd_loss = kd.detach();
    parts.cross_entropy = ce.detach();
    // As CausalLmLoss: the sum of the per-token losses / normalisation.tokens.
    parts.objective = parts.loss * (static_cast<double>(parts.tokens) / normalisation.tokens);
  } else {
    // As CausalLmLoss: a function of the logits with zero gradients, so that the backward runs
    // the same hooks and collectives as on the other ranks.
    parts.loss = at::zeros({}, logits.options().dtype(at::kFloat));
    parts.kd_loss = parts.loss;
    parts.cross_entropy = parts.loss;
    parts.objective = logits.sum() * 0.0;
  }
  if (moe_) add_router_aux_loss(parts, model, batch, aux_weight_, normalisation);
  return parts;
}

}  // namespace mdist::train
