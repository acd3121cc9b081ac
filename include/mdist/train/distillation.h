#pragma once
// Knowledge distillation as a training objective (modelopt's QAD: QADTrainer with its default
// LogitsDistillationLoss): every forward of the student is followed by the teacher's forward
// on the same micro-batch, under no-grad in eval mode, and the objective is the KD loss of
// distill_loss.h on the two logits, plus ce_weight x the causal-LM cross entropy when
// ce_weight > 0 (modelopt's QAD trains on KD alone: weight 0). The cross entropy is measured in
// any case, so a run logs both.
//
// The teacher is a model of its own: built, split and sharded on the student's layout (its own
// FSDP root; under tensor parallelism split over the same group, so its logits are the same
// vocabulary columns as the student's), never stepped or saved. Its logits live only until
// the loss of their micro-batch is computed.
#include <ATen/ATen.h>

#include <cstdint>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/parallelize.h"
#include "mdist/train/loss.h"

namespace mdist::train {

struct DistillationSettings {
  double temperature = 1.0;  // T of the KD loss (finite, > 0)
  double ce_weight = 0.0;    // W: the cross entropy's weight in the objective (>= 0)
};

// `teacher`: built on the student's layout (same tensor-parallel group, same vocabulary size).
// `student_config` and `aux_weight`: the student's load-balancing loss as CausalLmLoss takes it.
// Error for a teacher of another vocabulary size or bad settings.
class DistillationLoss final : public LossFunction {
 public:
  DistillationLoss(hf::ParallelModel teacher, const hf::LlamaConfig& student_config,
                   double aux_weight, DistillationSettings settings);
  std::int64_t predicted_tokens(const Batch& batch) const override;
  LossParts operator()(hf::CausalLM& model, const hf::Parallelism& parallelism,
                       const at::Tensor& logits, const Batch& batch,
                       const LossNormalisation& normalisation) override;
  bool reports_aux_loss() const override { return moe_; }
  double aux_loss_weight() const override { return aux_weight_; }
  bool reports_distillation() const override { return true; }

  const DistillationSettings& settings() const { return settings_; }
  hf::CausalLM& teacher() { return teacher_; }

 private:
  hf::CausalLM teacher_;
  hf::Parallelism teacher_parallelism_;
  bool moe_;
  double aux_weight_;
  DistillationSettings settings_;
};

}  // namespace mdist::train
