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

// Every FSDP unit of `model` (the root, its layers, its experts' units).
std::vector<FsdpHandle> fsdp_units_of(hf::CausalLM& model) {
  std::vector<FsdpHandle> units;
  for (const auto& module : model->modules(/*include_self=*/true)) {
    if (auto handle = fsdp_handle(*module)) units.push_back(*handle);
  }
  return units;
}

// FSDP's gradient sync on every unit of a step's micro-batches: off from construction when
// `pause` (the micro-batches before the last: their gradients accumulate unreduced on the full
// parameters), on again at resume() or at the end of its scope, also when a forward or
// backward throws, so that the next step reduces as usual.
class GradientSyncPause {
 public:
  GradientSyncPause(std::vector<FsdpHandle>& units, bool pause) : units_(units), paused_(pause) {
    if (paused_) set(false);
  }
  ~GradientSyncPause() { resume(); }
  GradientSyncPause(const GradientSyncPause&) = delete;
  GradientSyncPause& operator=(const GradientSyncPause&) = delete;
  void resume() {
    if (!paused_) return;
    set(true);
    paused_ = false;
  }

 private:
  void set(bool sync) {
    for (auto& unit : units_) unit.set_requires_gradient_sync(sync);
  }
  std::vector<FsdpHandle>& units_;
  bool paused_;
};

at::Tensor plus(const at::Tensor& total, const at::Tensor& value) {
  return total.defined() ? total + value : value;
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
      local_batch_(options_.global_batch / dp_size_),
      micro_batch_(options_.micro_batch.value_or(local_batch_)),
      fsdp_units_(fsdp_units_of(model_)) {
  if (options_.global_batch % dp_size_ != 0) {
    throw InputError("global batch " + std::to_string(options_.global_batch) +
                     " is not divisible by the data-parallel size " + std::to_string(dp_size_));
  }
  if (micro_batch_ < 1 || local_batch_ % micro_batch_ != 0) {
    throw InputError("micro-batch " + std::to_string(micro_batch_) +
                     " does not divide the per-rank batch " + std::to_string(local_batch_) +
                     " (global batch " + std::to_string(options_.global_batch) + " over " +
                     std::to_string(dp_size_) + " data-parallel ranks)");
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

Batch Trainer::next_batch() const {
  // This rank's slice of the step's global batch: the data-parallel ranks take consecutive
  // blocks of the run's stream (the tensor-parallel ranks of one take the same).
  std::vector<std::int64_t> which;
  for (std::int64_t b = 0; b < local_batch_; ++b) {
    which.push_back(state_.sequences_seen + dp_rank_ * local_batch_ + b);
  }
  return data_.rows(which).to(compute_device());
}

Trainer::BatchTotals Trainer::run_batch(const Batch& batch, int step) {
  const std::vector<Batch> micro = batch.split(micro_batch_);
  // The step's predicted tokens over every micro-batch and data-parallel rank, known before
  // the first backward: each micro-batch's objective is its loss sum over them (x dp, which
  // FSDP's averaging over the ranks takes back), so the accumulated gradient is the step's
  // per-token mean however the tokens fall into micro-batches and ranks.
  std::int64_t local_tokens = 0;
  for (const Batch& part : micro) local_tokens += loss_->predicted_tokens(part);
  const std::int64_t global_tokens =
      allreduce(local_tokens, "sum", parallel_.data_parallel_group.group());
  const LossNormalisation normalisation{.tokens = static_cast<double>(global_tokens) / dp_size_,
                                        .micro_batches = static_cast<int>(micro.size())};
  BatchTotals totals;
  GradientSyncPause sync(fsdp_units_, /*pause=*/micro.size() > 1);
  for (std::size_t k = 0; k < micro.size(); ++k) {
    // The last backward reduce-scatters the gradients accumulated over every micro-batch.
    if (k + 1 == micro.size()) sync.resume();
    const at::Tensor logits =
        model_->forward(micro[k].ids, micro[k].attention_mask, micro[k].position_ids);
    LossParts parts = (*loss_)(model_, parallelism_, logits, micro[k], normalisation);
    if (options_.nonfinite_steps.contains(step)) {
      const double nan = std::numeric_limits<double>::quiet_NaN();
      parts.loss = parts.loss * nan;
      parts.objective = parts.objective * nan;
    }
    parts.objective.backward();
    // loss x tokens in fp64 is exact (a float's 24 bits times fewer than 2^29 tokens), so the
    // step's mean without accumulation is bit for bit the forward's.
    totals.loss_sum = plus(totals.loss_sum,
                           parts.loss.detach().to(at::kDouble) * static_cast<double>(parts.tokens));
    totals.tokens += parts.tokens;
    if (parts.kd_loss.defined()) {
      const double tokens = static_cast<double>(parts.tokens);
      totals.kd_loss_sum =
          plus(totals.kd_loss_sum, parts.kd_loss.detach().to(at::kDouble) * tokens);
      totals.cross_entropy_sum =
          plus(totals.cross_entropy_sum, parts.cross_entropy.detach().to(at::kDouble) * tokens);
    }
    if (parts.aux_loss.defined()) {
      totals.aux_loss_sum = plus(totals.aux_loss_sum, parts.aux_loss.detach().to(at::kDouble));
    }
  }
  return totals;
}

StepStats Trainer::step() {
  StepStats stats;
  stats.step = state_.step + 1;
  const auto began = std::chrono::steady_clock::now();
  const Batch batch = next_batch();
  stats.lr = options_.schedule.at(stats.step);
  set_lr(*optimizer_, stats.lr);
  optimizer_->zero_grad();
  const std::int64_t sent_before = parallelism_.communication().all_to_all_bytes;
  const BatchTotals totals = run_batch(batch, stats.step);
  const double max_norm =
      options_.grad_clip > 0 ? options_.grad_clip : std::numeric_limits<double>::infinity();
  stats.grad_norm = hf::clip_grad_norm_(model_, parallelism_, max_norm);

  // One small all-gather per step, before the update: each rank's (loss sum, predicted
  // tokens, peak RSS, mean load-balancing loss over its micro-batches, bytes sent by
  // all-to-all). The loss is the step's per-token mean: the ranks' sums over all their tokens
  // (the tensor-parallel ranks of a data-parallel rank repeat its sum and its count alike).
  // Without accumulation each term is exactly the rank's mean / world, as the mean of the
  // ranks' means was. The loss and the global gradient norm are the same on every rank, so
  // every rank takes the same decision on a non-finite step.
  const bool moe = loss_->reports_aux_loss();
  const bool distillation = loss_->reports_distillation();
  const auto reports = allgather(std::tuple{
      totals.loss_sum.item<double>(), totals.tokens, peak_rss_mib(),
      moe ? totals.aux_loss_sum.item<double>() / static_cast<double>(micro_batches()) : 0.0,
      parallelism_.communication().all_to_all_bytes - sent_before,
      distillation ? totals.kd_loss_sum.item<double>() : 0.0,
      distillation ? totals.cross_entropy_sum.item<double>() : 0.0});
  const int world = mdist::size();
  std::int64_t tokens = 0;
  for (const auto& report : reports) tokens += std::get<1>(report);
  for (const auto& [rank_loss_sum, rank_tokens, peak, rank_aux, rank_sent, rank_kd, rank_ce] :
       reports) {
    stats.loss += rank_loss_sum / static_cast<double>(tokens);
    stats.kd_loss += rank_kd / static_cast<double>(tokens);
    stats.cross_entropy += rank_ce / static_cast<double>(tokens);
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
  // A micro-batch per forward: evaluation fits where training does.
  return held_out_loss(model_, parallelism_, held_out, parallel_, micro_batch_, max_sequences);
}

void Trainer::save(const std::filesystem::path& run_dir, int keep,
                   const std::vector<std::filesystem::path>& carried) {
  save_training_checkpoint(run_dir, model_, parallelism_, *optimizer_, state_, keep, parallel_,
                           carried);
}

}  // namespace mdist::train
