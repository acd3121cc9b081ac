#pragma once
// How many fully_shard units hold full parameters at once during training: unsharded, or
// with a (prefetch) all-gather in flight, whose output buffer is already allocated.
//
// Sampled at two points of each decoder layer: when its forward starts (a pre-hook
// registered after fully_shard's runs after the unit's unshard and the next unit's prefetch)
// and when its backward has just finished (a hook on the layer's input, which fully_shard has
// replaced by an alias whose autograd node reduce-scatters and reshards, fires right before
// that node).
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/nn/hooks.h"

namespace mdist::bench {

class UnshardWatch {
 public:
  void add_layer(FsdpHandle handle, int64_t full_bytes) {
    units_.push_back({std::move(handle), full_bytes, true});
  }
  void add_root(FsdpHandle handle, int64_t full_bytes) {
    units_.push_back({std::move(handle), full_bytes, false});
  }
  // Samples around `layer`'s forward and backward from now on; the watch must outlive the
  // model's training.
  void attach(torch::nn::Module& layer) {
    nn::register_forward_pre_hook(
        layer, [this](torch::nn::Module&, nn::TensorRefs& in) { on_forward(*in.front()); });
  }

  int max_units = 0;             // all units, the root included
  int max_layer_units = 0;       // decoder layers only
  int64_t max_bytes = 0;         // full parameters of the units counted in max_units
  int64_t backward_samples = 0;  // shows that the backward probe fired

 private:
  struct Unit {
    FsdpHandle handle;
    int64_t full_bytes;
    bool is_layer;
  };

  void sample() {
    int units = 0, layers = 0;
    int64_t bytes = 0;
    for (const auto& unit : units_) {
      if (unit.handle.is_unsharded() || unit.handle.is_gathering()) {
        ++units;
        layers += unit.is_layer ? 1 : 0;
        bytes += unit.full_bytes;
      }
    }
    max_units = std::max(max_units, units);
    max_layer_units = std::max(max_layer_units, layers);
    max_bytes = std::max(max_bytes, bytes);
  }

  void on_forward(at::Tensor& input) {
    sample();
    if (at::GradMode::is_enabled() && input.requires_grad()) {
      input.register_hook([this](const at::Tensor&) {
        ++backward_samples;
        sample();
      });
    }
  }

  std::vector<Unit> units_;
};

}  // namespace mdist::bench
