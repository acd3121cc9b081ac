#pragma once
// AdamW whose step is one fused kernel call per parameter group, device and dtype
// (at::_fused_adamw_, the kernel behind PyTorch's `torch.optim.AdamW(fused=True)`) instead of
// torch::optim::AdamW's half a dozen elementwise passes per tensor. Each element of a
// parameter, its gradient and both moments is read and written once per step.
//
// A drop-in torch::optim::AdamW: the same options (per-group lr, betas, eps, weight_decay,
// amsgrad), the same AdamWParamState per parameter (so optimizer checkpoints, state(), the
// learning-rate schedule and zero_grad work unchanged), the same update rule; results differ
// from torch::optim::AdamW by rounding only (the kernel evaluates the update in another
// order). Parameters are float, double, half or bfloat16, dense gradients only.
#include <torch/optim/adamw.h>

#include <utility>
#include <vector>

namespace mdist::optim {

class FusedAdamW : public torch::optim::AdamW {
 public:
  explicit FusedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                      torch::optim::AdamWOptions defaults = {})
      : torch::optim::AdamW(param_groups, std::move(defaults)) {}
  explicit FusedAdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults = {})
      : torch::optim::AdamW(std::move(params), std::move(defaults)) {}

  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace mdist::optim
