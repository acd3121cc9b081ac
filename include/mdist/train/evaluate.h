#pragma once
// The loss of a model on held-out sequences, as `mdist eval` reports it and the trainer logs
// it: per-token cross entropy summed in double over the sequences split across the
// data-parallel ranks, so that the total does not depend on the layout.
#include <cstdint>

#include "mdist/groups/parallel_state.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/hf/parallelize.h"
#include "mdist/train/sequences.h"

namespace mdist::train {

struct HeldOutLoss {
  double loss_sum = 0;      // nats, over every predicted token
  std::int64_t tokens = 0;  // predicted tokens
  double mean() const { return loss_sum / static_cast<double>(tokens); }
};

// Collective over the world: the first `max_sequences` sequences (0: all), `batch_size` per
// forward on each data-parallel rank, without gradients. Leaves the model in the mode it found
// it in. `parallelism`: how the model is split (its vocabulary, under tensor parallelism).
HeldOutLoss held_out_loss(hf::CausalLM& model, const hf::Parallelism& parallelism,
                          const SequenceSource& data, const ParallelState& parallel,
                          std::int64_t batch_size, std::int64_t max_sequences = 0);

}  // namespace mdist::train
