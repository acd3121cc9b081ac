#pragma once
// The objective of a training step, as an object the trainer calls, so that a run chooses it:
// CausalLmLoss (transformers' causal-LM cross entropy plus a mixture of experts'
// load-balancing loss) or DistillationLoss (a teacher's logits, distillation.h).
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/parallelize.h"
#include "mdist/train/sequences.h"

namespace mdist::train {

// How one micro-batch's objective is weighed within its optimizer step (gradient accumulation,
// normalised as torchtitan does): the objective of a micro-batch is the sum of its per-token
// losses divided by `tokens`, so that micro-batches with few predicted tokens (masked,
// ragged) weigh as little as they should and K micro-batches give the gradient of one batch
// of their union.
struct LossNormalisation {
  // The step's predicted tokens over every data-parallel rank and micro-batch, divided by the
  // data-parallel size: FSDP's reduce-scatter then averages the ranks' gradients (their sum /
  // dp), which makes the step's gradient that of (the sum of every per-token loss of the
  // step) / (the step's predicted tokens). Without accumulation and masks it is this rank's
  // own token count, and the objective is the plain mean.
  double tokens = 1;
  // A mixture of experts' load-balancing loss is a statistic of one forward (transformers
  // computes it per forward), not a sum over tokens: the objective takes each micro-batch's
  // with weight 1 / micro_batches, i.e. the step trains on the mean over its micro-batches.
  int micro_batches = 1;
};

// What one forward's objective is made of. `objective` is what backward runs on; the others
// are reported (undefined when the loss has no such part).
struct LossParts {
  at::Tensor objective;
  at::Tensor loss;          // mean cross entropy over the predicted tokens (the reported "loss")
  std::int64_t tokens = 0;  // those predicted tokens: the weight of `loss` in the step's mean
  at::Tensor aux_loss;      // a mixture of experts' load-balancing loss, before its weight
  // Distillation (distillation.h): the KD loss and the cross entropy, each a mean over the
  // same predicted tokens (`loss` is then KD + W x cross entropy). Undefined otherwise.
  at::Tensor kd_loss;
  at::Tensor cross_entropy;
};

class LossFunction {
 public:
  virtual ~LossFunction() = default;
  // The tokens of `batch` whose loss counts: the trainer sums them over the step's
  // micro-batches and data-parallel ranks before the first forward
  // (LossNormalisation::tokens).
  virtual std::int64_t predicted_tokens(const Batch& batch) const = 0;
  // `batch`: the micro-batch the model ran on; `logits`: its forward's output (this rank's
  // vocabulary columns under tensor parallelism, as `parallelism` says); `normalisation`: how
  // the objective is weighed in the step.
  virtual LossParts operator()(hf::CausalLM& model, const hf::Parallelism& parallelism,
                               const at::Tensor& logits, const Batch& batch,
                               const LossNormalisation& normalisation) = 0;
  // Whether parts.aux_loss is set (a mixture of experts).
  virtual bool reports_aux_loss() const = 0;
  // The weight of aux_loss in the objective (0: measured, not trained on).
  virtual double aux_loss_weight() const = 0;
  // Whether parts.kd_loss and parts.cross_entropy are set (distillation).
  virtual bool reports_distillation() const { return false; }
};

// The weight of a mixture of experts' load-balancing loss for `config`: `requested` when given
// (0: none), else the config's router_aux_loss_coef when its output_router_logits is true, else
// none, as transformers adds it. 0 for a dense model.
double aux_loss_weight(const hf::LlamaConfig& config, const std::optional<double>& requested);
// For the log: which of those rules gave the weight.
std::string describe_aux_loss_weight(const hf::LlamaConfig& config,
                                     const std::optional<double>& requested);

// HF's causal-LM loss (vocab-parallel under tensor parallelism: no rank builds the full
// logits) over the batch's predicted tokens (labels of -100 ignored) as a sum over them /
// normalisation.tokens, plus aux_weight / micro_batches x the load-balancing loss of the
// forward's routers (padding left out by the batch's attention mask). A micro-batch with no
// predicted token adds nothing (its loss reported as 0 over 0 tokens).
class CausalLmLoss final : public LossFunction {
 public:
  CausalLmLoss(const hf::LlamaConfig& config, double aux_weight);
  std::int64_t predicted_tokens(const Batch& batch) const override;
  LossParts operator()(hf::CausalLM& model, const hf::Parallelism& parallelism,
                       const at::Tensor& logits, const Batch& batch,
                       const LossNormalisation& normalisation) override;
  bool reports_aux_loss() const override { return moe_; }
  double aux_loss_weight() const override { return aux_weight_; }

 private:
  bool moe_;
  double aux_weight_;
};

}  // namespace mdist::train
