#pragma once
// Summary statistics of per-call latencies, printed as one JSON object per line so the
// driver script can put C++ and Python figures side by side.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace mdist::bench {

struct LatencySummary {
  double median_us = 0;
  double p10_us = 0;
  double p90_us = 0;
};

inline LatencySummary summarize(std::vector<double> samples_us) {
  std::sort(samples_us.begin(), samples_us.end());
  const auto at = [&](double q) {
    return samples_us[static_cast<std::size_t>(q * static_cast<double>(samples_us.size() - 1))];
  };
  return {at(0.5), at(0.1), at(0.9)};
}

// Times `calls` invocations of `fn` one by one, after `warmup` untimed ones.
template <class F>
std::vector<double> time_calls(int warmup, int calls, F&& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> samples;
  samples.reserve(static_cast<std::size_t>(calls));
  for (int i = 0; i < calls; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    const auto stop = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
  }
  return samples;
}

inline void print_json(const std::string& impl, const std::string& op, int world, int calls,
                       const LatencySummary& s) {
  std::printf(
      "{\"impl\": \"%s\", \"op\": \"%s\", \"world\": %d, \"calls\": %d, \"median_us\": %.2f, "
      "\"p10_us\": %.2f, \"p90_us\": %.2f}\n",
      impl.c_str(), op.c_str(), world, calls, s.median_us, s.p10_us, s.p90_us);
  std::fflush(stdout);
}

}  // namespace mdist::bench
