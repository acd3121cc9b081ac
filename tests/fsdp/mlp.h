#pragma once
// A small MLP whose forward calls its layers through mdist::nn::call, so fully_shard's hooks
// run for each wrapped layer, and routes its own forward through mdist::nn::hooked, so a
// wrapped root runs its hooks when called directly.
#include <torch/torch.h>

#include "mdist/nn/hooks.h"

namespace mdist::testing {

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 12));
    fc3 = register_module("fc3", torch::nn::Linear(12, 5));
  }
  at::Tensor forward(const at::Tensor& x) { return mdist::nn::hooked(*this, &MlpImpl::body, x); }
  at::Tensor body(const at::Tensor& x) {
    at::Tensor h = torch::relu(mdist::nn::call(fc1, x));
    h = torch::tanh(mdist::nn::call(fc2, h));
    return mdist::nn::call(fc3, h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

}  // namespace mdist::testing
