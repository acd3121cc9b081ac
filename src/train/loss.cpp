// See mdist/train/loss.h.
#include "mdist/train/loss.h"

#include <algorithm>
#include <cstdio>

#include "src/train/router_aux_loss.h"

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

std::int64_t CausalLmLoss::predicted_tokens(const Batch& batch) const {
  return train::predicted_tokens(batch);
}

LossParts CausalLmLoss::operator()(hf::CausalLM& model, const hf::Parallelism& parallelism,
                                   const at::Tensor& logits, const Batch& batch,
                                   const LossNormalisation& normalisation) {
  LossParts parts;
  parts.tokens = predicted_tokens(batch);
  if (parts.tokens > 0) {
    // With tensor parallelism the logits are this rank's vocabulary columns; the loss is the
    // whole vocabulary's (vocab-parallel cross entropy), the same on every rank of the group.
    parts.loss = hf::causal_lm_loss(parallelism, logits, batch.targets());
    // The sum of the per-token losses / normalisation.tokens, written as the mean x tokens /
    // normalisation.tokens: without accumulation that factor is exactly 1, so the objective
    // and its gradients are bit for bit the plain mean's.
    parts.objective = parts.loss * (static_cast<double>(parts.tokens) / normalisation.tokens);
  } else {
    // Nothing to predict (all prompt or padding): the mean over no token would be NaN. The
    // objective is still a function of the logits, so that its backward runs the same hooks
    // and collectives (FSDP's gradient reduction, tensor parallelism's) as on the other ranks,
    // with zero gradients. The tensor-parallel ranks of a data-parallel rank share its batch,
    // so they all take this branch together.
    parts.loss = at::zeros({}, logits.options().dtype(at::kFloat));
    parts.objective = logits.sum() * 0.0;
  }
  if (moe_) add_router_aux_loss(parts, model, batch, aux_weight_, normalisation);
  return parts;
}

}  // namespace mdist::train
