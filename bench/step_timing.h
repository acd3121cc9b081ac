#pragma once
// Step timing helpers shared by the training benchmarks (fsdp_train, tp_train).
#include <algorithm>
#include <chrono>
#include <vector>

namespace mdist::bench {

// The median (the lower one of an even count) of `values`.
inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[(values.size() - 1) / 2];
}

inline double seconds(std::chrono::steady_clock::time_point from,
                      std::chrono::steady_clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

}  // namespace mdist::bench
