// FusedAdamW: torch::optim::AdamW's state and options, stepped by at::_fused_adamw_.
#include "mdist/optim/fused_adamw.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "mdist/error.h"

namespace mdist::optim {
namespace {

// The tensors one kernel call updates: same device and dtype.
struct Bucket {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
};

}  // namespace

torch::Tensor FusedAdamW::step(LossClosure closure) {
  const at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    const at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    const auto [beta1, beta2] = options.betas();
    std::map<std::tuple<int, int, int>, Bucket> buckets;
    for (const auto& p : group.params()) {
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      if (grad.is_sparse()) {
        throw Error("mdist::optim::FusedAdamW: sparse gradients are not supported");
      }
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->step(0);
        fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        if (options.amsgrad()) {
          fresh->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        }
        slot = std::move(fresh);
      }
      auto& state = static_cast<torch::optim::AdamWParamState&>(*slot);
      state.step(state.step() + 1);
      Bucket& bucket =
          buckets[{static_cast<int>(p.scalar_type()), static_cast<int>(p.device().type()),
                   static_cast<int>(p.device().index())}];
      bucket.params.push_back(p);
      bucket.grads.push_back(grad);
      bucket.exp_avgs.push_back(state.exp_avg());
      bucket.exp_avg_sqs.push_back(state.exp_avg_sq());
      if (options.amsgrad()) bucket.max_exp_avg_sqs.push_back(state.max_exp_avg_sq());
      // The kernel reads the (already incremented) step count from a tensor on the
      // parameter's device, as PyTorch's fused path keeps it.
      bucket.steps.push_back(
          at::scalar_tensor(static_cast<double>(state.step()),
                            at::TensorOptions().dtype(at::kFloat).device(p.device())));
    }
    for (auto& [key, b] : buckets) {
      at::_fused_adamw_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.steps,
                        options.lr(), beta1, beta2, options.weight_decay(), options.eps(),
                        options.amsgrad(), /*maximize=*/false);
    }
  }
  return loss;
}

}  // namespace mdist::optim
