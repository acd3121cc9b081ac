// Activation checkpointing: an autograd node whose backward runs the function again and
// back-propagates through that recomputation (reentrant; why in mdist/nn/checkpoint.h).
#include "mdist/nn/checkpoint.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <c10/core/GradMode.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <optional>
#include <set>
#include <string>
#include <utility>

#include "mdist/error.h"

namespace mdist::nn {
namespace {

// One recompute running on this thread (its forward, then its nested backward).
struct RecomputeFrame {
  std::int64_t outer_backward = -1;  // the graph task the checkpoint's node runs in
  bool in_forward = false;
  std::vector<std::function<void()>> end_of_backward;  // for the outermost frame's task
};

// Innermost last. A recompute's nested backward runs on the thread that runs the node
// (autograd's reentrant backward), so the frames of one backward are on one thread.
thread_local std::vector<RecomputeFrame*> frames;

class FrameScope {
 public:
  explicit FrameScope(RecomputeFrame& frame) { frames.push_back(&frame); }
  ~FrameScope() { frames.pop_back(); }
  FrameScope(const FrameScope&) = delete;
  FrameScope& operator=(const FrameScope&) = delete;
};

// The generators' states to replay: the CPU one, and each CUDA device's that an input is on.
struct RngState {
  std::vector<std::pair<c10::Device, at::Tensor>> states;

  static RngState capture(const std::vector<c10::Device>& devices) {
    RngState rng;
    for (const auto& device : devices) {
      at::Generator generator = at::globalContext().defaultGenerator(device);
      const std::lock_guard lock(generator.mutex());
      rng.states.emplace_back(device, generator.get_state());
    }
    return rng;
  }

  void restore() const {
    for (const auto& [device, state] : states) {
      at::Generator generator = at::globalContext().defaultGenerator(device);
      const std::lock_guard lock(generator.mutex());
      generator.set_state(state);
    }
  }
};

std::vector<c10::Device> rng_devices(const std::vector<at::Tensor>& inputs) {
  std::set<c10::DeviceIndex> cuda;
  for (const auto& input : inputs) {
    if (input.defined() && input.is_cuda()) cuda.insert(input.device().index());
  }
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  for (const auto index : cuda) devices.emplace_back(c10::kCUDA, index);
  return devices;
}

// Restores the generators' states on scope exit: the recompute must not move the RNG that
// the rest of the backward (or the next step) sees.
class RngReplay {
 public:
  RngReplay(const RngState& replay, const std::vector<c10::Device>& devices)
      : saved_(RngState::capture(devices)) {
    replay.restore();
  }
  ~RngReplay() { saved_.restore(); }
  RngReplay(const RngReplay&) = delete;
  RngReplay& operator=(const RngReplay&) = delete;

 private:
  RngState saved_;
};

struct CheckpointNode : torch::autograd::Node {
  CheckpointFunction function;
  CheckpointOptions options;
  std::vector<at::Tensor> inputs;  // detached: the node holds no graph
  std::vector<bool> input_requires_grad;
  std::vector<std::uint32_t> input_versions;
  std::vector<std::size_t> output_of_input;  // node input k is the function's output [k]
  std::vector<c10::Device> devices;
  RngState rng;

  std::string name() const override { return "mdist::CheckpointBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].defined() && inputs[i]._version() != input_versions[i]) {
        throw Error("mdist::nn::checkpoint: input " + std::to_string(i) +
                    " was modified in place after the checkpointed forward");
      }
    }
    RecomputeFrame frame;
    frame.outer_backward = current_backward_id();
    const bool outermost = frames.empty();
    torch::autograd::variable_list leaves(inputs.size());
    {
      const FrameScope scope(frame);
      std::vector<at::Tensor> recompute_inputs = inputs;
      for (std::size_t i = 0; i < inputs.size(); ++i) {
        if (input_requires_grad[i]) {
          leaves[i] = inputs[i].detach().requires_grad_(true);
          recompute_inputs[i] = leaves[i];
        }
      }
      std::vector<at::Tensor> outputs;
      {
        std::optional<RngReplay> replay;
        if (options.preserve_rng_state) replay.emplace(rng, devices);
        const c10::AutoGradMode grad(true);
        frame.in_forward = true;
        try {
          outputs = function(recompute_inputs);
        } catch (...) {
          frame.in_forward = false;
          throw;
        }
        frame.in_forward = false;
      }
      if (outputs.size() <= (output_of_input.empty() ? 0 : output_of_input.back())) {
        throw Error("mdist::nn::checkpoint: the recompute returned " +
                    std::to_string(outputs.size()) + " outputs, fewer than the forward");
      }
      torch::autograd::variable_list roots, root_grads;
      for (std::size_t k = 0; k < grads.size(); ++k) {
        const at::Tensor& output = outputs[output_of_input[k]];
        if (grads[k].defined() && output.defined() && output.requires_grad()) {
          roots.push_back(output);
          root_grads.push_back(grads[k]);
        }
      }
      if (!roots.empty()) {
        torch::autograd::backward(roots, root_grads, /*retain_graph=*/false,
                                  /*create_graph=*/false);
      }
    }
    // Back in the outer graph task: what the recompute's backward asked to run at the end of
    // the backward is queued on it.
    if (outermost) {
      for (auto& callback : frame.end_of_backward) {
        torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
      }
    }
    torch::autograd::variable_list input_grads(inputs.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (leaves[i].defined()) input_grads[i] = leaves[i].grad();
    }
    return input_grads;
  }

  void release_variables() override {
    inputs.clear();
    function = nullptr;
  }
};

bool parameters_require_grad(const torch::nn::Module* module) {
  if (module == nullptr) return false;
  for (const auto& p : module->parameters(/*recurse=*/true)) {
    if (p.requires_grad()) return true;
  }
  return false;
}

}  // namespace

std::vector<at::Tensor> checkpoint(const CheckpointFunction& function,
                                   const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options) {
  if (!c10::GradMode::is_enabled()) return function(inputs);
  bool any_input_requires_grad = false;
  for (const auto& input : inputs) {
    any_input_requires_grad = any_input_requires_grad || (input.defined() && input.requires_grad());
  }
  if (!any_input_requires_grad && !parameters_require_grad(options.module)) {
    return function(inputs);
  }

  auto node = c10::make_intrusive<CheckpointNode>();
  node->function = function;
  node->options = options;
  node->devices = rng_devices(inputs);
  if (options.preserve_rng_state) node->rng = RngState::capture(node->devices);
  std::vector<at::Tensor> outputs;
  {
    const c10::AutoGradMode no_grad(false);
    outputs = function(inputs);
  }
  for (const auto& input : inputs) {
    node->inputs.push_back(input.defined() ? input.detach() : at::Tensor());
    node->input_requires_grad.push_back(input.defined() && input.requires_grad());
    node->input_versions.push_back(input.defined() ? input._version() : 0);
  }
  // Edges to the inputs' gradient functions (none for an input that needs no gradient).
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    at::Tensor& output = outputs[i];
    if (!output.defined() || !torch::autograd::isDifferentiableType(output.scalar_type())) continue;
    // tensor_data(): a new tensor on the same storage that is no view (a view's gradient
    // edge belongs to its base) and shares the version counter, so an in-place change of it
    // is still seen; an output that is an input keeps the input's own edge untouched.
    output = output.tensor_data();
    torch::autograd::impl::set_gradient_edge(
        output, torch::autograd::Edge(node, node->add_input_metadata(output)));
    node->output_of_input.push_back(i);
  }
  return outputs;
}

bool recomputing() { return !frames.empty() && frames.back()->in_forward; }

std::int64_t current_backward_id() {
  if (!frames.empty()) return frames.front()->outer_backward;
  return torch::autograd::get_current_graph_task_id();
}

void queue_end_of_backward(std::function<void()> callback) {
  if (!frames.empty()) {
    frames.front()->end_of_backward.push_back(std::move(callback));
    return;
  }
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

}  // namespace mdist::nn
