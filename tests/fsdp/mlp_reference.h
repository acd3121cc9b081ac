#pragma once
// The single-process reference the fully_shard tests (CPU and GPU) compare with: seeded Mlp,
// a seeded global batch per step (each rank takes its equal share), AdamW, and the trace of
// losses and final parameters of training on the whole batch in one process.
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "mdist/mdist.h"
#include "tests/fsdp/mlp.h"

namespace mdist::testing {

constexpr int kGlobalBatch = 12;  // divisible by 1, 2, 3 and 4 ranks
constexpr int kSteps = 5;

struct Data {
  at::Tensor x, y;
};

inline Data global_batch(int step) {
  torch::manual_seed(1000 + step);
  return {torch::randn({kGlobalBatch, 8}), torch::randn({kGlobalBatch, 5})};
}

// This rank's rows of the step's global batch, on `device`.
inline Data local_batch(int step, const c10::Device& device = c10::kCPU) {
  const Data all = global_batch(step);
  const int per_rank = kGlobalBatch / mdist::size();
  return {all.x.narrow(0, mdist::rank() * per_rank, per_rank).to(device),
          all.y.narrow(0, mdist::rank() * per_rank, per_rank).to(device)};
}

inline Mlp seeded_model() {
  torch::manual_seed(7);
  return Mlp();
}

inline double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>();
}

struct Trace {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> params;  // full parameters after training
};

inline torch::optim::AdamWOptions adamw() {
  return torch::optim::AdamWOptions(1e-2).weight_decay(0.01);
}

// kSteps of AdamW on the global batch in one process (on the CPU).
inline Trace train_reference() {
  Mlp model = seeded_model();
  torch::optim::AdamW opt(model->parameters(), adamw());
  Trace trace;
  for (int step = 0; step < kSteps; ++step) {
    const Data d = global_batch(step);
    opt.zero_grad();
    const at::Tensor loss = torch::mse_loss(model->forward(d.x), d.y);
    loss.backward();
    opt.step();
    trace.losses.push_back(loss.item<double>());
  }
  for (const auto& p : model->named_parameters())
    trace.params[p.key()] = p.value().detach().clone();
  return trace;
}

}  // namespace mdist::testing
