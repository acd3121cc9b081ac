#pragma once
// The trainer's optimizer: AdamW (betas 0.9/0.95, eps 1e-8) with decoupled weight decay on
// matrices only; norms' weights and biases are not decayed (the usual LLM recipe, and
// transformers' Trainer default). One fused kernel call per group (mdist::optim::FusedAdamW)
// with torch::optim::AdamW's state, so checkpoints are torch's.
#include <torch/optim/adamw.h>

#include <memory>

#include "mdist/hf/causal_lm.h"

namespace mdist::train {

std::unique_ptr<torch::optim::AdamW> make_adamw(hf::CausalLM& model, double lr,
                                                double weight_decay);
// Sets every group's learning rate.
void set_lr(torch::optim::Optimizer& optimizer, double lr);

}  // namespace mdist::train
