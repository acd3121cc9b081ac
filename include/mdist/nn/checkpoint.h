#pragma once
// Layer 4: activation checkpointing (libtorch has no C++ torch.utils.checkpoint).
//
//     auto out = mdist::nn::checkpoint(
//         [&](const std::vector<at::Tensor>& in) { return std::vector{mdist::nn::call(layer,
//         in[0])}; }, {x}, {.module = layer.get()});
//
// runs the function under no-grad, so none of its activations stay alive, and keeps only its
// tensor inputs and the RNG state (CPU, and each CUDA device an input is on). When backward
// reaches the outputs, the function runs again with grad enabled on detached copies of the
// inputs, the RNG state restored (dropout draws the same mask), and the incoming gradients are
// back-propagated through that recomputed graph: parameters get their gradients there, the
// inputs' gradients go on to the rest of the graph.
//
// Reentrant (torch.utils.checkpoint's use_reentrant=True), because the non-reentrant form
// needs saved-tensor pack/unpack hooks, which libtorch only exposes for Python callables
// (at::SavedTensorDefaultHooks holds PyObjects). The recompute's backward is a nested
// backward (a new autograd graph task) inside the outer one; code that keeps per-backward
// state (FSDP's end-of-backward callback) asks current_backward_id() and
// queue_end_of_backward() below, which look through checkpoint recomputes to the outer one.
//
// The function must be deterministic given its inputs, the RNG state and the parameters it
// reads (the same collectives on every rank, in the same order, as tensor and expert
// parallelism do). Its outputs get gradients through the checkpoint; anything else it leaves
// behind (a member tensor set in forward) is computed without grad: return it as an output.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace mdist::nn {

using CheckpointFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

struct CheckpointOptions {
  // The module the function runs, if any: when one of its parameters requires grad, the
  // outputs take part in backward even if no input does (a first layer after a frozen
  // embedding), so that the parameters still get their gradients.
  const torch::nn::Module* module = nullptr;
  // Replays the RNG state in the recompute (torch.utils.checkpoint's preserve_rng_state).
  bool preserve_rng_state = true;
};

// Runs `function(inputs)` keeping no activations (see above). With grad disabled, or when
// nothing it computes can need a gradient, it is a plain call. An input modified in place
// between forward and backward is an Error at backward, as PyTorch's saved tensors are.
std::vector<at::Tensor> checkpoint(const CheckpointFunction& function,
                                   const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options = {});

// Whether this thread is running a checkpointed function again in backward (its recompute).
bool recomputing();

// The id of the backward pass this thread runs in: the autograd graph task, or the outermost
// one when inside a checkpoint's nested backward. -1 outside backward.
std::int64_t current_backward_id();

// Runs `callback` at the end of the backward pass this thread runs in (the outermost one when
// inside a checkpoint's nested backward: queued on it once the nested backward returns).
void queue_end_of_backward(std::function<void()> callback);

}  // namespace mdist::nn
