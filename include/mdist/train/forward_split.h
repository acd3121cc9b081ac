#pragma once
// Forward-only passes (held-out loss, eval, calibrate) over windows split across data-parallel
// ranks. Rank r takes windows r, r + W, r + 2W, ...; every rank runs the same number of forwards
// (FSDP's all-gathers are collective), a rank that has run out of windows repeats window 0
// with its results discarded.
#include <algorithm>
#include <cstdint>
#include <vector>

namespace mdist::train {

struct ForwardPlan {
  // This rank's windows, in order.
  std::vector<std::int64_t> windows;
  // Forwards every rank runs: ceil(ceil(total / world) / batch).
  std::int64_t rounds = 0;
};

inline ForwardPlan plan_forwards(std::int64_t total, int world, int rank, std::int64_t batch) {
  ForwardPlan plan;
  for (std::int64_t w = rank; w < total; w += world) plan.windows.push_back(w);
  const std::int64_t per_rank = (total + world - 1) / world;
  plan.rounds = (per_rank + batch - 1) / batch;
  return plan;
}

}  // namespace mdist::train
