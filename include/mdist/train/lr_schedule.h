#pragma once
// The learning-rate schedule of the trainer (and so of `mdist train`): linear warm-up to the peak,
// then cosine decay to min_ratio * peak at the last step (the schedule most LLM pre-training
// recipes use).
#include <algorithm>
#include <cmath>
#include <numbers>

namespace mdist::train {

struct LrSchedule {
  double peak = 3e-3;
  int warmup_steps = 30;
  int total_steps = 300;
  double min_ratio = 0.1;

  // The rate for step `step` (1-based: the first optimizer step is step 1).
  double at(int step) const {
    if (warmup_steps > 0 && step <= warmup_steps) {
      return peak * static_cast<double>(step) / static_cast<double>(warmup_steps);
    }
    const int decay_steps = std::max(1, total_steps - warmup_steps);
    const double progress =
        std::clamp(static_cast<double>(step - warmup_steps) / decay_steps, 0.0, 1.0);
    const double floor = peak * min_ratio;
    return floor + (peak - floor) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  }
};

}  // namespace mdist::train
