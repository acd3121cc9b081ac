// `mdist train`: FSDP2 training of a causal LM on byte-level (or token-id) data.
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "mdist/ep/dispatch.h"
#include "mdist/fsdp/state_dict.h"
#include "mdist/hf/safetensors.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/objects/collectives.h"
#include "mdist/optim/fused_adamw.h"
#include "mdist/runtime/runtime.h"
#include "src/cli/checkpoint.h"
#include "src/cli/commands.h"
#include "src/cli/held_out.h"
#include "src/cli/job.h"
#include "src/cli/loss_plot.h"
#include "src/cli/progress.h"
#include "src/cli/run_dir.h"
#include "src/cli/schedule.h"
#include "src/cli/watchdog.h"

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
          {"tensor_parallel", o.io.tensor_parallel},  // informative: a resume may change them
          {"expert_parallel", o.io.expert_parallel},
          {"param_dtype", o.io.param_dtype.empty() ? "weights" : o.io.param_dtype},
          {"router_aux_loss_coef", o.router_aux_loss_coef ? nlohmann::json(*o.router_aux_loss_coef)
                                                          : nlohmann::json("config")}};
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
  // One fused kernel call per group instead of torch::optim::AdamW's per-tensor passes; the
  // same state, so checkpoints are unchanged.
  return std::make_unique<optim::FusedAdamW>(std::move(groups), options);
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

// (step, value of `key`) of every metrics line with a numeric `key` (a skipped step's null
// loss is left out).
std::vector<std::pair<int, double>> loss_points(const fs::path& metrics, const char* key) {
  std::vector<std::pair<int, double>> points;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto json = nlohmann::json::parse(line, nullptr, false);
    if (json.is_object() && json.contains(key) && json[key].is_number()) {
      points.emplace_back(json.value("step", 0), json[key].get<double>());
    }
  }
  return points;
}

// Steps whose loss is made NaN on purpose (MDIST_FAULT_NONFINITE_STEPS=2,5): a fault injection
// for the tests of --skip-nonfinite-steps and of resuming after a skipped step, which no small
// model reaches otherwise without blowing up for good. Empty when unset.
std::set<int> injected_nonfinite_steps() {
  std::set<int> steps;
  const char* env = std::getenv("MDIST_FAULT_NONFINITE_STEPS");
  if (env == nullptr) return steps;
  std::istringstream list(env);
  for (std::string item; std::getline(list, item, ',');) {
    try {
      steps.insert(std::stoi(item));
    } catch (const std::exception&) {
      throw InputError("MDIST_FAULT_NONFINITE_STEPS must list step numbers (2,5), got '" +
                       std::string(env) + "'");
    }
  }
  return steps;
}

std::string format_number(const char* fmt, double value) {
  char text[64];
  std::snprintf(text, sizeof(text), fmt, value);
  return text;
}

}  // namespace

int run_train(const TrainOptions& o) {
  const Session session(setup_options(o.io.timeout_s));
  configure_threads();
  const int world = size();
  const int tp = o.io.tensor_parallel;
  const int dp = tp >= 1 && world % tp == 0 ? world / tp : world;
  ModelChoice model_choice;
  TokenStream data;
  std::optional<TokenStream> held_out_data;
  std::optional<fs::path> resume_from;
  std::optional<TrainerState> resumed;
  bool replace_earlier = false;
  bool already_complete = false;  // --resume auto on a run that has reached --steps
  std::set<int> fault_steps;
  std::vector<std::string> warnings;
  std::optional<MixedPrecisionPolicy> mp_policy;
  agree_on_inputs([&] {
    mp_policy = parse_param_dtype(o.io.param_dtype);
    fault_steps = injected_nonfinite_steps();
    check_at_least(o.steps, 1, "--steps");
    check_at_least(o.global_batch, 1, "--global-batch");
    check_tensor_parallel_size(tp);
    check_expert_parallel_size(o.io.expert_parallel, tp);
    if (o.global_batch % dp != 0) {
      throw InputError("--global-batch " + std::to_string(o.global_batch) +
                       " is not divisible by the data-parallel size " + std::to_string(dp));
    }
    check_positive(o.lr, "--lr");
    if (!(o.min_lr_ratio >= 0 && o.min_lr_ratio <= 1)) {
      throw InputError(
          "--min-lr-ratio must be in [0, 1] (the end of the cosine decay as a "
          "fraction of --lr), got " +
          flag_value(o.min_lr_ratio));
    }
    check_at_least(o.warmup, 0, "--warmup");
    check_non_negative(o.weight_decay, "--weight-decay");
    check_non_negative(o.grad_clip, "--grad-clip (0: no clipping)");
    check_at_least(o.save_every, 0, "--save-every");
    check_at_least(o.keep, 1, "--keep");
    check_at_least(o.log_every, 1, "--log-every");
    if (o.eval_every) check_at_least(*o.eval_every, 0, "--eval-every");
    check_at_least(o.eval_max_sequences, 0, "--eval-max-sequences");
    check_non_negative(o.watchdog_s, "--watchdog");
    if (o.router_aux_loss_coef) {
      check_non_negative(*o.router_aux_loss_coef, "--router-aux-loss-coef (0: none)");
    }
    const bool automatic = o.resume == ResumeMode::automatic;
    if (o.resume == ResumeMode::always && o.io.model_dir) {
      throw InputError("--resume continues from the last checkpoint of '" + o.out.string() +
                       "', which is the model; --model cannot be given with it");
    }
    if (o.resume != ResumeMode::off && o.overwrite) {
      throw InputError("--resume and --overwrite exclude each other");
    }
    check_writable_dir(o.out, "output directory");
    RunLock::check_free(o.out);
    ResumePoint point;
    if (o.resume != ResumeMode::off) point = resume_point(o.out);
    const auto& latest = point.checkpoint;
    warnings = point.warnings;
    if (o.resume == ResumeMode::always && !latest) {
      throw InputError("--resume: no checkpoint in '" + (o.out / "checkpoints").string() + "'");
    }
    if (latest) {
      resume_from = latest;
      resumed = read_trainer_state(*resume_from);
    } else if (const auto earlier = earlier_run(o.out)) {
      // --resume auto with no complete checkpoint: what is there (metrics of a run that never
      // saved, a partial step directory) is nothing to continue; it is replaced.
      if (!o.overwrite && !automatic) {
        throw InputError("output directory '" + o.out.string() + "' holds an earlier run (" +
                         *earlier + "); pass --resume to continue it or --overwrite to replace it");
      }
      if (o.io.model_dir && is_within(*o.io.model_dir, o.out)) {
        throw InputError("--model '" + o.io.model_dir->string() + "' is inside '" + o.out.string() +
                         "', the run " + (automatic ? "--resume auto" : "--overwrite") +
                         " would replace; copy it elsewhere first");
      }
      replace_earlier = true;
    }
    // A resumed run's model is its checkpoint (an HF directory).
    model_choice = resume_from      ? model_from_dir(*resume_from)
                   : o.io.model_dir ? model_from_dir(*o.io.model_dir)
                                    : default_model();
    check_tensor_parallel(tp, model_choice.config);
    check_expert_parallel(o.io.expert_parallel, tp, model_choice.config);
    data = load_checked_data(o.io, DataSplit::train, model_choice, "train");
    if (o.eval_every.value_or(1) > 0) {
      if (o.eval_data) {
        ModelDataOptions held = o.io;
        held.data = o.eval_data;
        held.split = "all";
        held_out_data = load_checked_data(held, DataSplit::all, model_choice, "train --eval-data");
      } else if (const bool train_split =
                     o.io.split == "train" || (o.io.split == "auto" && !o.io.data);
                 train_split) {
        ModelDataOptions held = o.io;
        held.split = "eval";
        held_out_data =
            load_checked_data(held, DataSplit::eval, model_choice, "train (eval split)");
      } else if (o.eval_every) {
        throw InputError(
            "--eval-every needs held-out data: --eval-data FILE, or --split train "
            "(the held-out part is then the last 10% of --data)");
      }
    }
    if (resumed) {
      check_resume_flags(resumed->run, run_flags(o, data, model_choice), *resume_from);
      model_choice.description = resume_from->string() + " (resumed)";
      if (resumed->step >= o.steps && automatic) {
        // A restart after the last checkpoint (a rank that died in teardown): nothing to do.
        already_complete = true;
        return;
      }
      if (resumed->step >= o.steps) {
        throw InputError("--resume: the checkpoint is at step " + std::to_string(resumed->step) +
                         ", not before --steps " + std::to_string(o.steps));
      }
      const auto optimizer_state =
          check_optimizer_state(*resume_from, model_choice.config, resumed->step);
      if (!optimizer_state.per_parameter_steps) {
        warnings.push_back("checkpoint " + resume_from->string() +
                           " (written by an earlier mdist) keeps no per-parameter AdamW step: "
                           "every parameter resumes at step " +
                           std::to_string(resumed->step) +
                           ", which is not exact for a parameter that missed steps (an expert "
                           "without tokens, a skipped step)");
      }
    }
  });
  for (const auto& warning : warnings) say("mdist train: warning: " + warning);
  if (already_complete) {
    say("mdist train: the run in " + o.out.string() + " is already complete (" +
        resume_from->string() + " is at step " + std::to_string(resumed->step) + " of --steps " +
        std::to_string(o.steps) + "); nothing to do, nothing written");
    return 0;
  }
  const Windows windows(data, o.io.seq_len, "train");
  WindowOrder order(windows.count(), o.io.seed);
  std::optional<Windows> held_out;
  if (held_out_data) held_out.emplace(*held_out_data, o.io.seq_len, "train (held out)");
  const JobLayout layout = make_layout(tp, o.io.expert_parallel);
  const ParallelState& parallel = layout.parallel;
  const int dp_rank = mdist::rank(parallel.data_parallel_group.group());
  const hf::ParallelModel built = build_wrapped_model(model_choice, o.io.seed, layout, mp_policy);
  hf::CausalLM model = built.model;
  const hf::Parallelism& parallelism = built.parallelism;
  // The run directory is this job's from here on (rank 0 holds the lock; a second job into
  // the same directory gets one line naming this one's pid). Taken once the model is known to
  // be good, so that a bad checkpoint leaves no lock file behind; the earlier run goes only now.
  std::unique_ptr<RunLock> lock;
  agree_on_inputs([&] {
    if (rank() == 0) lock = std::make_unique<RunLock>(o.out);
  });
  if (rank() == 0 && replace_earlier) remove_earlier_run(o.out);
  model->train();
  auto optimizer = make_optimizer(model, o);
  const LrSchedule schedule{o.lr, o.warmup, o.steps, o.min_lr_ratio};
  TrainerState state;
  state.run = run_flags(o, data, model_choice);

  const fs::path metrics_path = o.out / "metrics.jsonl";
  if (rank() == 0) fs::create_directories(o.out);
  std::vector<std::string> earlier_metrics;
  if (resumed) {
    load_training_checkpoint(*resume_from, model, parallelism, *optimizer, *resumed, parallel);
    state.step = resumed->step;
    state.sequences_seen = resumed->sequences_seen;
    state.skipped_steps = resumed->skipped_steps;
    if (rank() == 0) earlier_metrics = metrics_up_to(metrics_path, state.step);
  }
  std::ofstream metrics;
  if (rank() == 0) {
    std::string kept;
    for (const auto& line : earlier_metrics) kept += line + "\n";
    hf::write_file_atomically(metrics_path, kept);
    metrics.open(metrics_path, std::ios::app);
  }

  say("mdist train: " + describe_layout(layout) + ", model " + model_choice.description);
  say("mdist train: " + tokenizer_line(model_choice));
  if (mp_policy) say("mdist train: " + describe_mixed_precision(*mp_policy, model));
  // A mixture of experts' objective: the loss plus aux_coef x the load-balancing loss, as
  // transformers adds it only when the config's output_router_logits is true.
  const auto& moe = model->config.moe;
  const double aux_coef = !moe ? 0.0
                               : o.router_aux_loss_coef.value_or(
                                     moe->output_router_logits ? moe->router_aux_loss_coef : 0.0);
  if (moe) {
    say("mdist train: load-balancing loss " +
        (aux_coef > 0 ? "in the objective with weight " + flag_value(aux_coef)
                      : std::string("not in the objective")) +
        (o.router_aux_loss_coef      ? " (--router-aux-loss-coef)"
         : moe->output_router_logits ? " (the config's router_aux_loss_coef, output_router_logits "
                                       "true)"
                                     : " (the config's output_router_logits is false; "
                                       "--router-aux-loss-coef W adds it)"));
  }
  say("mdist train: data " + data.description + ", " + std::to_string(windows.count()) +
      " sequences of " + std::to_string(o.io.seq_len) + " tokens; global batch " +
      std::to_string(o.global_batch) + " (" + std::to_string(o.global_batch / dp) +
      " per data-parallel rank), steps " + std::to_string(state.step + 1) + ".." +
      std::to_string(o.steps) +
      (resumed ? " (resumed from " + resume_from->string() +
                     (o.io.model_dir ? "; --model is only where a fresh run starts" : "") + ")"
       : o.resume == ResumeMode::automatic ? " (--resume auto: no checkpoint yet, starting)"
                                           : ""));
  say(held_out ? "mdist train: held-out loss on " + held_out_data->description + " (" +
                     std::to_string(o.eval_max_sequences > 0
                                        ? std::min(o.eval_max_sequences, held_out->count())
                                        : held_out->count()) +
                     " sequences) " +
                     (o.eval_every ? "every " + std::to_string(*o.eval_every) + " steps"
                                   : std::string("at each checkpoint"))
               : std::string("mdist train: no held-out loss (") +
                     (o.eval_every ? "--eval-every 0"
                                   : "no held-out data: --eval-data or --split train") +
                     ")");

  Progress progress(stdout, o.log_every);
  const int64_t local_batch = o.global_batch / dp;
  const int64_t T = o.io.seq_len;
  // --grad-clip 0: no clipping (the norm is still measured, for the log and the finiteness
  // check).
  const double max_norm = o.grad_clip > 0 ? o.grad_clip : std::numeric_limits<double>::infinity();
  StepWatchdog watchdog(std::chrono::milliseconds(static_cast<int64_t>(o.watchdog_s * 1000)));
  const auto started = std::chrono::steady_clock::now();
  int steps_here = 0;
  for (int step = state.step + 1; step <= o.steps; ++step) {
    watchdog.reached(step);
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
    const int64_t sent_before = parallelism.communication().all_to_all_bytes;
    const at::Tensor logits = model->forward(ids);
    // With tensor parallelism the logits are this rank's vocabulary columns; the loss is the
    // whole vocabulary's (vocab-parallel cross entropy), the same on every rank of the group.
    const at::Tensor loss = fault_steps.contains(step)
                                ? hf::causal_lm_loss(parallelism, logits, ids) *
                                      std::numeric_limits<double>::quiet_NaN()
                                : hf::causal_lm_loss(parallelism, logits, ids);
    // The load-balancing loss (every token of a window is real: no mask) is measured for the
    // log in any case, and in the objective with weight aux_coef.
    const at::Tensor aux = moe ? model->aux_loss() : at::Tensor();
    (aux_coef > 0 ? loss + aux_coef * aux.to(loss.device()) : loss).backward();
    const double grad_norm = hf::clip_grad_norm_(model, parallelism, max_norm);

    // One small all-gather per step, before the update: each rank's (loss, peak RSS). Every
    // rank's batch has the same number of tokens, so the mean of the ranks' means is the
    // global batch's mean loss (the tensor-parallel ranks of a data-parallel rank repeat its
    // loss, each as many times). The loss and the global gradient norm are the same on every
    // rank, so every rank takes the same decision on a non-finite step.
    // A mixture of experts also reports its load-balancing loss (the ranks' mean, as the loss).
    // Under expert parallelism, also the bytes each rank sent to others by all-to-all in
    // the step (tokens to their experts and back, forward and backward).
    const auto reports =
        allgather(std::tuple{loss.item<double>(), peak_rss_mib(), moe ? aux.item<double>() : 0.0,
                             parallelism.communication().all_to_all_bytes - sent_before});
    double mean_loss = 0, mean_aux = 0;
    std::vector<double> peaks;
    std::vector<int64_t> sent;
    for (const auto& [rank_loss, peak, rank_aux, rank_sent] : reports) {
      mean_loss += rank_loss / world;
      mean_aux += rank_aux / world;
      peaks.push_back(peak);
      sent.push_back(rank_sent);
    }
    const bool finite =
        std::isfinite(mean_loss) && std::isfinite(mean_aux) && std::isfinite(grad_norm);
    if (!finite && !o.skip_nonfinite) {
      progress.finish();
      const auto last = latest_checkpoint(o.out);
      throw AgreedFailure(
          "step " + std::to_string(step) + ": the " +
              (std::isfinite(mean_loss) ? "gradient norm is " + flag_value(grad_norm)
                                        : "loss is " + flag_value(mean_loss)) +
              "; stopped before the optimizer step, nothing saved (" +
              (last ? "the last checkpoint is " + last->string() : std::string("no checkpoint")) +
              "). Lower --lr, or pass --skip-nonfinite-steps to skip such steps",
          rank() == 0, 1);
    }
    if (finite) {
      optimizer->step();
    } else {
      ++state.skipped_steps;  // the batch is consumed, the weights and moments are unchanged
    }
    state.step = step;
    state.sequences_seen += o.global_batch;
    const double step_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - step_began).count();
    ++steps_here;
    if (rank() == 0) {
      nlohmann::json line = {
          {"step", step},
          // JSON has no NaN or infinity: a non-finite value is null.
          {"loss", std::isfinite(mean_loss) ? nlohmann::json(mean_loss) : nlohmann::json(nullptr)},
          {"lr", lr},
          {"tokens_per_s", static_cast<double>(o.global_batch * T) / step_s},
          {"step_time_s", step_s},
          {"grad_norm",
           std::isfinite(grad_norm) ? nlohmann::json(grad_norm) : nlohmann::json(nullptr)},
          {"peak_rss_mib", peaks},
      };
      if (moe) {
        line["aux_loss"] =
            std::isfinite(mean_aux) ? nlohmann::json(mean_aux) : nlohmann::json(nullptr);
        line["router_aux_loss_coef"] = aux_coef;  // its weight in the objective (0: not in it)
        if (layout.expert_parallel() > 1) line["all_to_all_bytes"] = sent;
      }
      if (o.skip_nonfinite) {
        line["skipped"] = !finite;
        line["skipped_steps"] = state.skipped_steps;
      }
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
    const bool save = (o.save_every > 0 && step % o.save_every == 0) || step == o.steps;
    const bool evaluate =
        held_out && (o.eval_every ? (step % *o.eval_every == 0 || step == o.steps) : save);
    if (evaluate) {
      const HeldOutLoss held =
          held_out_loss(model, parallelism, *held_out, parallel, local_batch, o.eval_max_sequences);
      if (rank() == 0) {
        const nlohmann::json line = {{"step", step},
                                     {"eval_loss", held.mean()},
                                     {"eval_perplexity", std::exp(held.mean())},
                                     {"eval_tokens", held.tokens}};
        metrics << line.dump() << '\n' << std::flush;
        progress.note("mdist train: step " + std::to_string(step) + ": held-out loss " +
                      format_number("%.4f", held.mean()) + ", perplexity " +
                      format_number("%.3f", std::exp(held.mean())));
      }
    }
    if (save) {
      save_training_checkpoint(o.out, model, parallelism, *optimizer, state, o.keep, parallel,
                               tokenizer_files(model_choice));
    }
  }
  progress.finish();
  if (rank() == 0) {
    metrics.close();
    const auto points = loss_points(metrics_path, "loss");
    hf::write_file_atomically(o.out / "loss.svg",
                              loss_curve_svg(points, "mdist train: " + data.description,
                                             loss_points(metrics_path, "eval_loss")));
    say("mdist train: done; final loss " +
        format_number("%.4f", points.empty() ? 0.0 : points.back().second) +
        (state.skipped_steps > 0
             ? " (" + std::to_string(state.skipped_steps) + " non-finite step(s) skipped)"
             : std::string()) +
        ". Wrote " + metrics_path.string() + ", " + (o.out / "loss.svg").string() +
        " and checkpoint " + (o.out / "checkpoints").string() + "/" + "latest");
  }
  return 0;
}

}  // namespace mdist::cli
