// See mdist/train/trainer.h.
#include "mdist/train/trainer.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <tuple>

#include "mdist/objects/collectives.h"
#include "mdist/runtime/device.h"
#include "mdist/runtime/runtime.h"
#include "mdist/train/memory.h"
#include "mdist/train/optimizer.h"

namespace mdist::train {
namespace {

std::string number(double value) {
  if (std::isnan(value)) return "nan";
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

}  // namespace

NonFiniteStep::NonFiniteStep(int step, double loss, double grad_norm)
    : Error("step " + std::to_string(step) + ": the " +
            (std::isfinite(loss) ? "gradient norm is " + number(grad_norm)
                                 : "loss is " + number(loss)) +
            "; stopped before the optimizer step"),
      step_(step),
      loss_(loss),
      grad_norm_(grad_norm) {}

Trainer::Trainer(hf::ParallelModel model, ParallelState parallel, SequenceSource data,
                 TrainerOptions options, std::unique_ptr<LossFunction> loss, nlohmann::json run)
    : model_(std::move(model.model)),
      parallelism_(std::move(model.parallelism)),
      parallel_(std::move(parallel)),
      data_(std::move(data)),
      options_(std::move(options)),
      loss_(std::move(loss)),
      dp_size_(mdist::size(parallel_.data_parallel_group.group())),
      dp_rank_(mdist::rank(parallel_.data_parallel_group.group())),
      local_batch_(options_.global_batch / dp_size_) {
  if (options_.global_batch % dp_size_ != 0) {
    throw InputError("global batch " + std::to_string(options_.global_batch) +
                     " is not divisible by the data-parallel size " + std::to_string(dp_size_));
  }
  model_->train();
  optimizer_ = make_adamw(model_, options_.schedule.peak, options_.weight_decay);
  state_.run = std::move(run);
}

Trainer::~Trainer() = default;

void Trainer::resume(const std::filesystem::path& checkpoint, const TrainerState& state) {
  load_training_checkpoint(checkpoint, model_, parallelism_, *optimizer_, state, parallel_);
  state_.step = state.step;
  state_.sequences_seen = state.sequences_seen;
  state_.skipped_steps = state.skipped_steps;
}

at::Tensor Trainer::next_batch() const {
  // This rank's slice of the step's global batch: the data-parallel ranks take consecutive
  // blocks of the run's stream (the tensor-parallel ranks of one take the same).
  std::vector<std::int64_t> which;
  for (std::int64_t b = 0; b < local_batch_; ++b) {
    which.push_back(state_.sequences_seen + dp_rank_ * local_batch_ + b);
  }
  return data_.rows(which).to(compute_device());
}

LossParts Trainer::run_batch(const at::Tensor& ids, int step) {
  const at::Tensor logits = model_->forward(ids);
  LossParts parts = (*loss_)(model_, parallelism_, logits, ids);
  if (options_.nonfinite_steps.contains(step)) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    parts.loss = parts.loss * nan;
    parts.objective = parts.objective * nan;
  }
  parts.objective.backward();
  return parts;
}

StepStats Trainer::step() {
  StepStats stats;
  stats.step = state_.step + 1;
  const auto began = std::chrono::steady_clock::now();
  const at::Tensor ids = next_batch();
  stats.lr = options_.schedule.at(stats.step);
  set_lr(*optimizer_, stats.lr);
  optimizer_->zero_grad();
  const std::int64_t sent_before = parallelism_.communication().all_to_all_bytes;
  const LossParts parts = run_batch(ids, stats.step);
  const double max_norm =
      options_.grad_clip > 0 ? options_.grad_clip : std::numeric_limits<double>::infinity();
  stats.grad_norm = hf::clip_grad_norm_(model_, parallelism_, max_norm);

  // One small all-gather per step, before the update: each rank's (loss, peak RSS, aux loss,
  // bytes sent by all-to-all). Every rank's batch has the same number of tokens, so the mean
  // of the ranks' means is the global batch's mean loss (the tensor-parallel ranks of a
  // data-parallel rank repeat its loss, each as many times). The loss and the global gradient
  // norm are the same on every rank, so every rank takes the same decision on a non-finite
  // step.
  const bool moe = loss_->reports_aux_loss();
  const auto reports = allgather(std::tuple{
      parts.loss.item<double>(), peak_rss_mib(), moe ? parts.aux_loss.item<double>() : 0.0,
      parallelism_.communication().all_to_all_bytes - sent_before});
  const int world = mdist::size();
  for (const auto& [rank_loss, peak, rank_aux, rank_sent] : reports) {
    stats.loss += rank_loss / world;
    stats.aux_loss += rank_aux / world;
    stats.peak_rss_mib.push_back(peak);
    stats.all_to_all_bytes.push_back(rank_sent);
  }
  const bool finite =
      std::isfinite(stats.loss) && std::isfinite(stats.aux_loss) && std::isfinite(stats.grad_norm);
  if (!finite && !options_.skip_nonfinite) {
    throw NonFiniteStep(stats.step, stats.loss, stats.grad_norm);
  }
  if (finite) {
    optimizer_->step();
  } else {
    stats.skipped = true;
    ++state_.skipped_steps;  // the batch is consumed, the weights and moments are unchanged
  }
  state_.step = stats.step;
  state_.sequences_seen += options_.global_batch;
  stats.step_time_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  stats.tokens_per_s =
      static_cast<double>(options_.global_batch * data_.length) / stats.step_time_s;
  return stats;
}

HeldOutLoss Trainer::evaluate(const SequenceSource& held_out, std::int64_t max_sequences) {
  return held_out_loss(model_, parallelism_, held_out, parallel_, local_batch_, max_sequences);
}

void Trainer::save(const std::filesystem::path& run_dir, int keep,
                   const std::vector<std::filesystem::path>& carried) {
  save_training_checkpoint(run_dir, model_, parallelism_, *optimizer_, state_, keep, parallel_,
                           carried);
}

}  // namespace mdist::train
