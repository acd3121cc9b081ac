#pragma once
// The data the trainer and the held-out evaluation read: a set of equal-length token sequences
// addressed by index. The caller adapts its own data (mdist train: the windows of a token file,
// in its seeded epoch order) so that the library stays free of file formats.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mdist::train {

struct SequenceSource {
  std::int64_t count = 0;   // sequences; a training source is read past it (next epochs)
  std::int64_t length = 0;  // tokens per sequence
  // The sequences `which` as an int64 tensor [which.size(), length] on the CPU. A training
  // source is addressed by position in the run's stream (0, 1, 2, ... over every epoch), which
  // it maps to its own order.
  std::function<at::Tensor(const std::vector<std::int64_t>& which)> rows;
  std::string description;  // for logs and metrics
};

}  // namespace mdist::train
