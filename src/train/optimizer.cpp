// See mdist/train/optimizer.h.
#include "mdist/train/optimizer.h"

#include <torch/torch.h>

#include <vector>

#include "mdist/fsdp/state_dict.h"
#include "mdist/optim/fused_adamw.h"

namespace mdist::train {

std::unique_ptr<torch::optim::AdamW> make_adamw(hf::CausalLM& model, double lr,
                                                double weight_decay) {
  std::vector<at::Tensor> decay, no_decay;
  for (const auto& [name, place] : param_placements(*model)) {
    (place.full_shape.size() >= 2 ? decay : no_decay).push_back(place.param);
  }
  auto options = torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(options).weight_decay(weight_decay)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(options).weight_decay(0.0)));
  return std::make_unique<optim::FusedAdamW>(std::move(groups), options);
}

void set_lr(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
}

}  // namespace mdist::train
