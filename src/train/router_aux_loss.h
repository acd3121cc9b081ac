#pragma once
// The mixture-of-experts load-balancing term every LossFunction of the training library adds
// (CausalLmLoss in loss.cpp, DistillationLoss in distillation.cpp): one place, so the two
// objectives weigh it the same way.
#include "mdist/train/loss.h"

namespace mdist::train {

// Measures `model`'s load-balancing loss of this forward into parts.aux_loss (for the log, in
// any case) and, when `weight` > 0, adds it to parts.objective with weight / micro_batches: the
// term is a statistic of one forward, so the step trains on its mean over the micro-batches
// (LossNormalisation::micro_batches). `parts.loss` must be set (its device is the objective's).
inline void add_router_aux_loss(LossParts& parts, hf::CausalLM& model, const Batch& batch,
                                const double weight, const LossNormalisation& normalisation) {
  parts.aux_loss = model->aux_loss(batch.attention_mask);
  if (weight > 0) {
    parts.objective = parts.objective + (weight / normalisation.micro_batches) *
                                            parts.aux_loss.to(parts.loss.device());
  }
}

}  // namespace mdist::train
