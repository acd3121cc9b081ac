// `mdist train`: FSDP2 training of a causal LM on byte-level (or token-id) data.
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "mdist/fsdp/state_dict.h"
#include "mdist/hf/safetensors.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"
#include "src/cli/checkpoint.h"
#include "src/cli/commands.h"
#include "src/cli/job.h"
#include "src/cli/loss_plot.h"
#include "src/cli/progress.h"
#include "src/cli/schedule.h"

namespace mdist::cli {
namespace {

namespace fs = std::filesystem;

// The flags that must not change across --resume (they decide which data each step sees).
nlohmann::json run_flags(const TrainOptions& o, const TokenStream& data, const ModelChoice& model) {
  return {{"seq_len", o.io.seq_len},
          {"global_batch", o.global_batch},
          {"seed", o.io.seed},
          {"data", data.description},
          {"model", model.description},
          {"lr", o.lr},
          {"min_lr_ratio", o.min_lr_ratio},
          {"warmup", o.warmup},
          {"weight_decay", o.weight_decay},
          {"grad_clip", o.grad_clip},
          {"steps", o.steps},
          {"tensor_parallel", o.io.tensor_parallel}};  // informative: a resume may change it
}

void check_resume_flags(const nlohmann::json& saved, const nlohmann::json& now,
                        const fs::path& checkpoint) {
  for (const char* key : {"seq_len", "global_batch", "seed", "data"}) {
    if (saved.contains(key) && saved[key] != now[key]) {
      throw InputError("--resume: " + std::string(key) + " is " + now[key].dump() +
                       " but the checkpoint " + checkpoint.string() + " was trained with " +
                       saved[key].dump());
    }
  }
}

// AdamW with decoupled weight decay on matrices only: norms' weights and biases are not
// decayed (the usual LLM recipe, and transformers' Trainer default).
std::unique_ptr<torch::optim::AdamW> make_optimizer(hf::CausalLM& model, const TrainOptions& o) {
  std::vector<at::Tensor> decay, no_decay;
  for (const auto& [name, place] : param_placements(*model)) {
    (place.full_shape.size() >= 2 ? decay : no_decay).push_back(place.param);
  }
  auto options = torch::optim::AdamWOptions(o.lr).betas({0.9, 0.95}).eps(1e-8);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(options).weight_decay(o.weight_decay)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(options).weight_decay(0.0)));
  return std::make_unique<torch::optim::AdamW>(std::move(groups), options);
}

void set_lr(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
}

// The metrics file of a resumed run keeps the lines up to the checkpoint's step.
std::vector<std::string> metrics_up_to(const fs::path& path, int step) {
  std::vector<std::string> kept;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto json = nlohmann::json::parse(line, nullptr, false);
    if (json.is_object() && json.value("step", 0) <= step) kept.push_back(line);
  }
  return kept;
}

std::vector<std::pair<int, double>> loss_points(const fs::path& metrics) {
  std::vector<std::pair<int, double>> points;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto json = nlohmann::json::parse(line, nullptr, false);
    if (json.is_object() && json.contains("loss")) {
      points.emplace_back(json.value("step", 0), json.value("loss", 0.0));
    }
  }
  return points;
}

std::string format_number(const char* fmt, double value) {
  char text[64];
  std::snprintf(text, sizeof(text), fmt, value);
  return text;
}

}  // namespace

int run_train(const TrainOptions& o) {
  const Session session;
  configure_threads();
  const int world = size();
  const int tp = o.io.tensor_parallel;
  const int dp = tp >= 1 && world % tp == 0 ? world / tp : world;
  ModelChoice model_choice;
  TokenStream data;
  std::optional<fs::path> resume_from;
  std::optional<TrainerState> resumed;
  agree_on_inputs([&] {
    if (o.steps < 1) throw InputError("--steps must be at least 1");
    if (o.global_batch < 1) throw InputError("--global-batch must be at least 1");
    check_tensor_parallel_size(tp);
    if (o.global_batch % dp != 0) {
      throw InputError("--global-batch " + std::to_string(o.global_batch) +
                       " is not divisible by the data-parallel size " + std::to_string(dp));
    }
    if (!(o.lr > 0)) throw InputError("--lr must be positive");
    if (o.warmup < 0) throw InputError("--warmup must not be negative");
    check_writable_dir(o.out, "output directory");
    if (o.resume) {
      resume_from = latest_checkpoint(o.out);
      if (!resume_from) {
        throw InputError("--resume: no checkpoint in '" + (o.out / "checkpoints").string() + "'");
      }
      resumed = read_trainer_state(*resume_from);
    }
    // A resumed run's model is its checkpoint (an HF directory), whatever --model says.
    model_choice = resume_from      ? model_from_dir(*resume_from)
                   : o.io.model_dir ? model_from_dir(*o.io.model_dir)
                                    : default_model();
    check_tensor_parallel(tp, model_choice.config);
    data = load_checked_data(o.io, DataSplit::train, model_choice, "train");
    if (resumed) {
      check_resume_flags(resumed->run, run_flags(o, data, model_choice), *resume_from);
      model_choice.description = resume_from->string() + " (resumed)";
      if (resumed->step >= o.steps) {
        throw InputError("--resume: the checkpoint is at step " + std::to_string(resumed->step) +
                         ", not before --steps " + std::to_string(o.steps));
      }
    }
  });

  const Windows windows(data, o.io.seq_len, "train");
  WindowOrder order(windows.count(), o.io.seed);
  const ParallelState parallel = make_layout(tp);
  const int dp_rank = parallel.data_parallel_group.rank();
  hf::CausalLM model = build_wrapped_model(model_choice, o.io.seed, parallel);
  model->train();
  auto optimizer = make_optimizer(model, o);
  const LrSchedule schedule{o.lr, o.warmup, o.steps, o.min_lr_ratio};
  TrainerState state;
  state.run = run_flags(o, data, model_choice);

  const fs::path metrics_path = o.out / "metrics.jsonl";
  if (rank() == 0) fs::create_directories(o.out);
  std::vector<std::string> earlier_metrics;
  if (resumed) {
    load_training_checkpoint(*resume_from, model, *optimizer, *resumed, parallel);
    state.step = resumed->step;
    state.sequences_seen = resumed->sequences_seen;
    if (rank() == 0) earlier_metrics = metrics_up_to(metrics_path, state.step);
  }
  std::ofstream metrics;
  if (rank() == 0) {
    std::string kept;
    for (const auto& line : earlier_metrics) kept += line + "\n";
    hf::write_file_atomically(metrics_path, kept);
    metrics.open(metrics_path, std::ios::app);
  }

  say("mdist train: " + describe_layout(parallel) + ", model " + model_choice.description);
  say("mdist train: data " + data.description + ", " + std::to_string(windows.count()) +
      " sequences of " + std::to_string(o.io.seq_len) + " tokens; global batch " +
      std::to_string(o.global_batch) + " (" + std::to_string(o.global_batch / dp) +
      " per data-parallel rank), steps " + std::to_string(state.step + 1) + ".." +
      std::to_string(o.steps) + (resumed ? " (resumed from " + resume_from->string() + ")" : ""));

  Progress progress(stdout, o.log_every);
  const int64_t local_batch = o.global_batch / dp;
  const int64_t T = o.io.seq_len;
  const auto started = std::chrono::steady_clock::now();
  int steps_here = 0;
  for (int step = state.step + 1; step <= o.steps; ++step) {
    const auto step_began = std::chrono::steady_clock::now();
    // This rank's slice of the step's global batch.
    std::vector<int64_t> which;
    for (int64_t b = 0; b < local_batch; ++b) {
      which.push_back(order.window_of(state.sequences_seen + dp_rank * local_batch + b));
    }
    const at::Tensor ids = batch_of(windows, which).to(compute_device());
    const double lr = schedule.at(step);
    set_lr(*optimizer, lr);
    optimizer->zero_grad();
    const at::Tensor logits = model->forward(ids);
    // With tensor parallelism the logits are this rank's vocabulary columns; the loss is the
    // whole vocabulary's (vocab-parallel cross entropy), the same on every rank of the group.
    const at::Tensor loss = hf::causal_lm_loss(model, logits, ids);
    loss.backward();
    const double grad_norm = hf::clip_grad_norm_(model, o.grad_clip);
    optimizer->step();
    state.step = step;
    state.sequences_seen += o.global_batch;

    // One small all-gather per step for the log: each rank's (loss, peak RSS). Every rank's
    // batch has the same number of tokens, so the mean of the ranks' means is the global
    // batch's mean loss (the tensor-parallel ranks of a data-parallel rank repeat its loss,
    // each as many times).
    const auto reports = allgather(std::pair{loss.item<double>(), peak_rss_mib()});
    double mean_loss = 0;
    std::vector<double> peaks;
    for (const auto& [rank_loss, peak] : reports) {
      mean_loss += rank_loss / world;
      peaks.push_back(peak);
    }
    const double step_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - step_began).count();
    ++steps_here;
    if (rank() == 0) {
      const nlohmann::json line = {
          {"step", step},
          {"loss", mean_loss},
          {"lr", lr},
          {"tokens_per_s", static_cast<double>(o.global_batch * T) / step_s},
          {"step_time_s", step_s},
          {"grad_norm", grad_norm},
          {"peak_rss_mib", peaks},
      };
      metrics << line.dump() << '\n' << std::flush;
      progress.update(
          {.step = step,
           .total_steps = o.steps,
           .loss = mean_loss,
           .lr = lr,
           .tokens_per_s = static_cast<double>(o.global_batch * T) / step_s,
           .elapsed_s =
               std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
           .steps_done_here = steps_here,
           .peak_rss_mib = peaks});
    }
    if (!std::isfinite(mean_loss)) {
      progress.finish();
      throw Error("mdist train: the loss is not finite at step " + std::to_string(step) +
                  " (lower --lr?)");
    }
    if ((o.save_every > 0 && step % o.save_every == 0) || step == o.steps) {
      save_training_checkpoint(o.out, model, *optimizer, state, o.keep, parallel);
    }
  }
  progress.finish();
  if (rank() == 0) {
    metrics.close();
    const auto points = loss_points(metrics_path);
    hf::write_file_atomically(o.out / "loss.svg",
                              loss_curve_svg(points, "mdist train: " + data.description));
    say("mdist train: done; final loss " +
        format_number("%.4f", points.empty() ? 0.0 : points.back().second) + ". Wrote " +
        metrics_path.string() + ", " + (o.out / "loss.svg").string() + " and checkpoint " +
        (o.out / "checkpoints").string() + "/" + "latest");
  }
  return 0;
}

}  // namespace mdist::cli
