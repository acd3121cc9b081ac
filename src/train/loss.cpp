// See mdist/train/loss.h.
#include "mdist/train/loss.h"

#include <algorithm>
#include <cstdio>

namespace mdist::train {
namespace {

std::string number(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

}  // namespace

double aux_loss_weight(const hf::LlamaConfig& config, const std::optional<double>& requested) {
  const auto& moe = config.moe;
  if (!moe) return 0.0;
  return requested.value_or(moe->output_router_logits ? moe->router_aux_loss_coef : 0.0);
}

std::string describe_aux_loss_weight(const hf::LlamaConfig& config,
                                     const std::optional<double>& requested) {
  const double weight = aux_loss_weight(config, requested);
  return "load-balancing loss " +
         (weight > 0 ? "in the objective with weight " + number(weight)
                     : std::string("not in the objective")) +
         (requested                          ? " (--router-aux-loss-coef)"
          : config.moe->output_router_logits ? " (the config's router_aux_loss_coef, "
                                               "output_router_logits true)"
                                             : " (the config's output_router_logits is false; "
                                               "--router-aux-loss-coef W adds it)");
}

CausalLmLoss::CausalLmLoss(const hf::LlamaConfig& config, double aux_weight)
    : moe_(config.moe.has_value()), aux_weight_(aux_weight) {}

std::int64_t CausalLmLoss::predicted_tokens(const at::Tensor& ids) const {
  // Each position but the last predicts the next token; no label is ignored.
  return ids.size(0) * std::max<std::int64_t>(ids.size(1) - 1, 0);
}

LossParts CausalLmLoss::operator()(hf::CausalLM& model, const hf::Parallelism& parallelism,
                                   const at::Tensor& logits, const at::Tensor& ids,
                                   const LossNormalisation& normalisation) {
  LossParts parts;
  // With tensor parallelism the logits are this rank's vocabulary columns; the loss is the
  // whole vocabulary's (vocab-parallel cross entropy), the same on every rank of the group.
  parts.loss = hf::causal_lm_loss(parallelism, logits, ids);
  parts.tokens = predicted_tokens(ids);
  // The sum of the per-token losses / normalisation.tokens, written as the mean x tokens /
  // normalisation.tokens: without accumulation that factor is exactly 1, so the objective and
  // its gradients are bit for bit the plain mean's.
  parts.objective = parts.loss * (static_cast<double>(parts.tokens) / normalisation.tokens);
  if (moe_) {
    // Measured for the log in any case; in the objective with its weight, each micro-batch's
    // forward for its share of the step (LossNormalisation::micro_batches).
    parts.aux_loss = model->aux_loss();
    if (aux_weight_ > 0) {
      parts.objective = parts.objective + (aux_weight_ / normalisation.micro_batches) *
                                              parts.aux_loss.to(parts.loss.device());
    }
  }
  return parts;
}

}  // namespace mdist::train
