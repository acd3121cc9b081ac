#pragma once
// An autograd node with one input and one output whose backward is a function of the
// gradient: how the collectives of tp/ and ep/ give a communication its backward
// communication without a torch::autograd::Function subclass per collective.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <functional>
#include <string>
#include <utility>

namespace mdist::nn::detail {

struct GradientFunction : torch::autograd::Node {
  GradientFunction(std::string label, std::function<at::Tensor(const at::Tensor&)> backward)
      : label_(std::move(label)), backward_(std::move(backward)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    return {backward_(grads[0])};
  }
  std::string name() const override { return label_; }

 private:
  std::string label_;
  std::function<at::Tensor(const at::Tensor&)> backward_;
};

// `output` (a tensor without history) becomes the result of a node from `input` with the given
// backward, when autograd records.
inline at::Tensor with_backward(const at::Tensor& input, at::Tensor output, const char* label,
                                std::function<at::Tensor(const at::Tensor&)> backward) {
  if (!at::GradMode::is_enabled() || !input.requires_grad()) return output;
  auto node = c10::make_intrusive<GradientFunction>(label, std::move(backward));
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  torch::autograd::impl::set_gradient_edge(
      output, torch::autograd::Edge(node, node->add_input_metadata(output)));
  return output;
}

}  // namespace mdist::nn::detail
