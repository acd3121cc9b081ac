#pragma once
// The trainer: one object that owns a model being trained, its AdamW, the learning-rate
// schedule, the objective and the run's position (TrainerState), and that takes a step, runs a
// held-out evaluation, saves and resumes. `mdist train` is flag parsing, logging and a loop of
// step() around it; so can any program that links the library be.
//
// Where the features that build on it go:
//   - the objective is a LossFunction (loss.h): CausalLmLoss, or DistillationLoss
//     (distillation.h: a teacher model's logits);
//   - micro-batches (gradient accumulation): step() splits the rank's batch into micro-batches
//     of TrainerOptions::micro_batch sequences, runs forward and backward on each with the
//     gradient sync of FSDP only on the last, then takes the one optimizer step
//     (Trainer::run_batch); the objective is normalised by the step's global token count
//     (LossNormalisation);
//   - quantization-aware training: quantizers are inserted into the model (its hooks) before
//     the trainer is built; their state joins save()/resume() next to the optimizer's.
#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "mdist/error.h"
#include "mdist/fsdp/fully_shard.h"
#include "mdist/groups/parallel_state.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/hf/parallelize.h"
#include "mdist/train/checkpoint.h"
#include "mdist/train/evaluate.h"
#include "mdist/train/loss.h"
#include "mdist/train/lr_schedule.h"
#include "mdist/train/sequences.h"

namespace torch::optim {
class AdamW;
}

namespace mdist::train {

struct TrainerOptions {
  int steps = 300;                 // the run's last step (a resumed run continues to it)
  std::int64_t global_batch = 16;  // sequences per step over all data-parallel ranks
  // Sequences per data-parallel rank per forward: the rank's global_batch / dp sequences run as
  // global_batch / (dp x micro_batch) micro-batches, their gradients accumulated into one
  // optimizer step. nullopt: one forward over the rank's whole batch (no accumulation).
  std::optional<std::int64_t> micro_batch;
  LrSchedule schedule;  // its total_steps is `steps`
  double weight_decay = 0.1;
  double grad_clip = 1.0;  // max global gradient norm; 0: no clipping (the norm is measured)
  // A step whose loss or gradient norm is not finite: skipped (the batch consumed, nothing
  // updated, counted) when true; else step() throws NonFiniteStep before the update.
  bool skip_nonfinite = false;
  // Fault injection for tests: the loss of these steps is made NaN.
  std::set<int> nonfinite_steps;
};

// What one step did, the same on every rank.
struct StepStats {
  int step = 0;
  double loss = 0;      // mean over the global batch (non-finite when it was)
  double aux_loss = 0;  // mean of the ranks' load-balancing losses (a mixture of experts)
  // Distillation (LossFunction::reports_distillation): the KD loss and the cross entropy, each
  // a mean over the global batch's predicted tokens as `loss` (which is KD + W x CE).
  double kd_loss = 0;
  double cross_entropy = 0;
  double grad_norm = 0;
  double lr = 0;
  double step_time_s = 0;
  double tokens_per_s = 0;
  bool skipped = false;              // not finite, skipped (TrainerOptions::skip_nonfinite)
  std::vector<double> peak_rss_mib;  // per rank
  std::vector<std::int64_t> all_to_all_bytes;  // per rank: sent by expert parallelism
};

// A step's loss or gradient norm was not finite and skip_nonfinite is off: thrown on every rank
// alike before the optimizer step (the weights and moments are those of the step before).
class NonFiniteStep : public Error {
 public:
  NonFiniteStep(int step, double loss, double grad_norm);
  int step() const { return step_; }
  double loss() const { return loss_; }
  double grad_norm() const { return grad_norm_; }

 private:
  int step_;
  double loss_, grad_norm_;
};

class Trainer {
 public:
  // `model`: built, split and sharded on `parallel`'s layout (hf::apply_parallelism), with how
  // it is split. `data`: the training stream (a SequenceSource addressed by position). `run`:
  // the run's flags kept in checkpoints.
  Trainer(hf::ParallelModel model, ParallelState parallel, SequenceSource data,
          TrainerOptions options, std::unique_ptr<LossFunction> loss, nlohmann::json run);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Continues from `checkpoint`, whose trainer_state.json is `state` (read_trainer_state);
  // the model must have been built from the checkpoint's weights. Collective.
  void resume(const std::filesystem::path& checkpoint, const TrainerState& state);
  bool done() const { return state_.step >= options_.steps; }
  // One optimizer step on the next global batch (this rank's slice of it). Collective.
  StepStats step();
  // Held-out loss on the first `max_sequences` of `held_out` (0: all), the trainer's
  // micro-batch per forward (its memory is what training needs). Collective.
  HeldOutLoss evaluate(const SequenceSource& held_out, std::int64_t max_sequences);
  // A checkpoint of the current step into run_dir/checkpoints (save_training_checkpoint).
  void save(const std::filesystem::path& run_dir, int keep,
            const std::vector<std::filesystem::path>& carried);

  const TrainerState& state() const { return state_; }
  const TrainerOptions& options() const { return options_; }
  const LossFunction& loss() const { return *loss_; }
  hf::CausalLM& model() { return model_; }
  const hf::Parallelism& parallelism() const { return parallelism_; }
  std::int64_t local_batch() const { return local_batch_; }
  std::int64_t micro_batch() const { return micro_batch_; }
  // Forwards (and backwards) per step on each rank: local_batch() / micro_batch().
  std::int64_t micro_batches() const { return local_batch_ / micro_batch_; }

 private:
  // What this rank's forwards of a step add up to (detached, reduced by step()).
  struct BatchTotals {
    at::Tensor loss_sum;  // sum over micro-batches of mean loss x predicted tokens (fp64)
    std::int64_t tokens = 0;
    at::Tensor aux_loss_sum;  // sum over micro-batches of the load-balancing loss (fp64)
    // Distillation: sums over micro-batches of mean x predicted tokens (fp64), as loss_sum.
    at::Tensor kd_loss_sum;
    at::Tensor cross_entropy_sum;
  };
  // Forward and backward over this rank's batch, micro-batch by micro-batch, FSDP's gradient
  // sync only on the last. Collective.
  BatchTotals run_batch(const Batch& batch, int step);
  Batch next_batch() const;

  hf::CausalLM model_;
  hf::Parallelism parallelism_;
  ParallelState parallel_;
  SequenceSource data_;
  TrainerOptions options_;
  std::unique_ptr<LossFunction> loss_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  TrainerState state_;
  int dp_size_, dp_rank_;
  std::int64_t local_batch_, micro_batch_;
  // Every FSDP unit of the model (its gradient sync is paused for all but the last
  // micro-batch).
  std::vector<FsdpHandle> fsdp_units_;
};

}  // namespace mdist::train
