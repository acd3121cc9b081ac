#pragma once
// The objective of a training step, as an object the trainer calls, so that a run chooses it:
// CausalLmLoss today (transformers' causal-LM cross entropy plus a mixture of experts'
// load-balancing loss), a distillation loss (a teacher's logits) next.
#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/parallelize.h"

namespace mdist::train {

// What one forward's objective is made of. `objective` is what backward runs on; the others
// are reported (undefined when the loss has no such part).
struct LossParts {
  at::Tensor objective;
  at::Tensor loss;      // the cross entropy (the reported "loss")
  at::Tensor aux_loss;  // a mixture of experts' load-balancing loss, before its weight
};

class LossFunction {
 public:
  virtual ~LossFunction() = default;
  // `ids` [B, T]: the batch the model ran on (labels are the inputs shifted by one);
  // `logits`: its forward's output (this rank's vocabulary columns under tensor parallelism,
  // as `parallelism` says).
  virtual LossParts operator()(hf::CausalLM& model, const hf::Parallelism& parallelism,
                               const at::Tensor& logits, const at::Tensor& ids) = 0;
  // Whether parts.aux_loss is set (a mixture of experts).
  virtual bool reports_aux_loss() const = 0;
  // The weight of aux_loss in the objective (0: measured, not trained on).
  virtual double aux_loss_weight() const = 0;
};

// The weight of a mixture of experts' load-balancing loss for `config`: `requested` when given
// (0: none), else the config's router_aux_loss_coef when its output_router_logits is true, else
// none, as transformers adds it. 0 for a dense model.
double aux_loss_weight(const hf::LlamaConfig& config, const std::optional<double>& requested);
// For the log: which of those rules gave the weight.
std::string describe_aux_loss_weight(const hf::LlamaConfig& config,
                                     const std::optional<double>& requested);

// HF's causal-LM loss (vocab-parallel under tensor parallelism: no rank builds the full
// logits), plus aux_weight x the load-balancing loss of the forward's routers (every token of a
// sequence is real: no mask).
class CausalLmLoss final : public LossFunction {
 public:
  CausalLmLoss(const hf::LlamaConfig& config, double aux_weight);
  LossParts operator()(hf::CausalLM& model, const hf::Parallelism& parallelism,
                       const at::Tensor& logits, const at::Tensor& ids) override;
  bool reports_aux_loss() const override { return moe_; }
  double aux_loss_weight() const override { return aux_weight_; }

 private:
  bool moe_;
  double aux_weight_;
};

}  // namespace mdist::train
