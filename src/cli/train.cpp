// `mdist train`: the training library's Trainer (mdist/train/trainer.h) driven from the flags:
// the inputs checked and agreed on, the model built on the job's layout, then a loop of steps
// with logging, held-out evaluation and checkpoints.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>

#include "mdist/hf/activation_checkpointing.h"
#include "mdist/io/atomic_file.h"
#include "mdist/runtime/runtime.h"
#include "mdist/train/checkpoint.h"
#include "mdist/train/metrics.h"
#include "mdist/train/trainer.h"
#include "src/cli/commands.h"
#include "src/cli/export_dir.h"
#include "src/cli/job.h"
#include "src/cli/loss_plot.h"
#include "src/cli/progress.h"
#include "src/cli/qat_export.h"
#include "src/cli/qat_from_export.h"
#include "src/cli/run_dir.h"
#include "src/cli/sft_data.h"
#include "src/cli/train_distill.h"
#include "src/cli/train_quant.h"
#include "src/cli/watchdog.h"

namespace mdist::cli {
namespace {

namespace fs = std::filesystem;

// The flags that must not change across --resume (they decide which data each step sees).
nlohmann::json run_flags(const TrainOptions& o, const std::string& data, const ModelChoice& model) {
  return {{"seq_len", o.io.seq_len},
          {"global_batch", o.global_batch},
          {"seed", o.io.seed},
          {"data", data},
          {"model", model.description},
          {"lr", o.lr},
          {"min_lr_ratio", o.min_lr_ratio},
          {"warmup", o.warmup},
          {"weight_decay", o.weight_decay},
          {"grad_clip", o.grad_clip},
          {"steps", o.steps},
          {"tensor_parallel", o.io.tensor_parallel},  // informative: a resume may change them
          {"micro_batch", o.micro_batch ? nlohmann::json(*o.micro_batch) : nlohmann::json("all")},
          {"expert_parallel", o.io.expert_parallel},
          {"param_dtype", o.io.param_dtype.empty() ? "weights" : o.io.param_dtype},
          {"router_aux_loss_coef", o.router_aux_loss_coef ? nlohmann::json(*o.router_aux_loss_coef)
                                                          : nlohmann::json("config")},
          {"quant", describe_qat(o)},
          {"distillation", describe_distillation(o.distill)}};
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

// What the checks found, agreed on by every rank before anything is written.
struct TrainInputs {
  ModelChoice model;
  TokenStream data;
  std::optional<TokenStream> held_out_data;
  // --format sft: the examples instead of `data` / `held_out_data`.
  std::optional<SftSequences> sft;
  std::optional<SftSequences> held_out_sft;
  std::optional<fs::path> resume_from;
  std::optional<train::TrainerState> resumed;
  bool replace_earlier = false;
  bool already_complete = false;  // --resume auto on a run that has reached --steps
  std::set<int> fault_steps;
  std::vector<std::string> warnings;
  std::optional<MixedPrecisionPolicy> mp_policy;
  // --quant with --calib-data: the calibration data (else the training data's windows).
  std::optional<TokenStream> calib_data;
  std::optional<ModelChoice> teacher;  // --teacher
};

const std::string& data_description(const TrainInputs& in) {
  return in.sft ? in.sft->description : in.data.description;
}

// Where the run starts: its checkpoint (--resume), or a fresh start that may replace an earlier
// run (--overwrite, or --resume auto without a complete checkpoint).
void find_start(const TrainOptions& o, TrainInputs& in) {
  const bool automatic = o.resume == ResumeMode::automatic;
  check_writable_dir(o.out, "output directory");
  RunLock::check_free(o.out);
  train::ResumePoint point;
  if (o.resume != ResumeMode::off) point = train::resume_point(o.out);
  in.warnings = point.warnings;
  if (o.resume == ResumeMode::always && !point.checkpoint) {
    throw InputError("--resume: no checkpoint in '" + (o.out / "checkpoints").string() + "'");
  }
  if (point.checkpoint) {
    in.resume_from = point.checkpoint;
    in.resumed = train::read_trainer_state(*in.resume_from);
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
    in.replace_earlier = true;
  }
}

// The held-out data: --eval-data, else the eval split when training on the train split.
void find_held_out_data(const TrainOptions& o, TrainInputs& in) {
  if (o.eval_every.value_or(1) <= 0) return;
  if (o.eval_data && o.io.sft()) {
    in.held_out_sft = load_checked_sft(*o.eval_data, o.io, in.model);
  } else if (o.eval_data) {
    ModelDataOptions held = o.io;
    held.data = o.eval_data;
    held.split = "all";
    in.held_out_data = load_checked_data(held, DataSplit::all, in.model, "train --eval-data");
  } else if (o.io.split == "train" || (o.io.split == "auto" && !o.io.data)) {
    ModelDataOptions held = o.io;
    held.split = "eval";
    in.held_out_data = load_checked_data(held, DataSplit::eval, in.model, "train (eval split)");
  } else if (o.eval_every) {
    throw InputError(
        "--eval-every needs held-out data: --eval-data FILE, or --split train "
        "(the held-out part is then the last 10% of --data)");
  }
}

// A resumed run: its flags must fit the checkpoint, which must be before --steps (or, under
// --resume auto, the run is complete) and hold valid optimizer state.
void check_resumed(const TrainOptions& o, TrainInputs& in) {
  // QAT: the quantizers come from the checkpoint, calibrated as its run was; a run resumes
  // with the --quant flags it started with (describe_qat), QAT or not.
  const nlohmann::json& saved = in.resumed->run;
  const std::string saved_quant =
      saved.contains("quant") ? saved["quant"].get<std::string>() : std::string("none");
  if (saved_quant != describe_qat(o)) {
    throw InputError("--resume: --quant is " + describe_qat(o) + " but the checkpoint " +
                     in.resume_from->string() + " was trained with --quant " + saved_quant +
                     "; resume with the --quant flags the run started with");
  }
  if (!o.quant.empty() && !fs::exists(*in.resume_from / kQatStateFile)) {
    throw InputError("--resume: the checkpoint " + in.resume_from->string() +
                     " of quantization-aware training has no " + kQatStateFile);
  }
  check_resumed_distillation(saved, o.distill, *in.resume_from);
  check_resume_flags(in.resumed->run, run_flags(o, data_description(in), in.model),
                     *in.resume_from);
  in.model.description = in.resume_from->string() + " (resumed)";
  if (in.resumed->step >= o.steps && o.resume == ResumeMode::automatic) {
    // A restart after the last checkpoint (a rank that died in teardown): nothing to do.
    in.already_complete = true;
    return;
  }
  if (in.resumed->step >= o.steps) {
    throw InputError("--resume: the checkpoint is at step " + std::to_string(in.resumed->step) +
                     ", not before --steps " + std::to_string(o.steps));
  }
  const auto optimizer_state =
      train::check_optimizer_state(*in.resume_from, in.model.config, in.resumed->step);
  if (!optimizer_state.per_parameter_steps) {
    in.warnings.push_back("checkpoint " + in.resume_from->string() +
                          " (written by an earlier mdist) keeps no per-parameter AdamW step: "
                          "every parameter resumes at step " +
                          std::to_string(in.resumed->step) +
                          ", which is not exact for a parameter that missed steps (an expert "
                          "without tokens, a skipped step)");
  }
}

// --export-quantized DIR: a directory the export can be written to, not the run's own (its
// config.json would make the run directory look like a checkpoint).
void check_export_target(const TrainOptions& o) {
  std::error_code ec;
  if (fs::weakly_canonical(*o.export_quantized, ec) == fs::weakly_canonical(o.out, ec)) {
    throw InputError("--export-quantized '" + o.export_quantized->string() +
                     "' is the run directory --out; name another directory");
  }
  check_export_dir(*o.export_quantized, "--export-quantized");
}

// Every input of the run, checked on every rank and agreed on (one line from rank 0, exit 2,
// nothing written, when any is bad).
TrainInputs check_inputs(const TrainOptions& o) {
  TrainInputs in;
  agree_on_inputs([&] {
    in.mp_policy = parse_param_dtype(o.io.param_dtype);
    in.fault_steps = injected_nonfinite_steps();
    check_train_flags(o, size());
    find_start(o, in);
    // A resumed run's model is its checkpoint (an HF directory).
    in.model = in.resume_from   ? model_from_dir(*in.resume_from)
               : o.io.model_dir ? model_from_dir(*o.io.model_dir)
                                : default_model();
    // A quantized export starts QAT in its own format (qat_from_export.h), nothing else.
    check_qat_start_model(o, in.model);
    if (!o.quant.empty() && in.model.config.moe && in.model.quantization) {
      // Reading a mixture of experts' export back into fused-expert quantizers is untested.
      throw InputError("--model '" + in.model.dir->string() +
                       "' is a quantized export of a mixture of experts; quantization-aware "
                       "training of one starts from its unquantized weights only yet");
    }
    check_tensor_parallel(o.io.tensor_parallel, in.model.config);
    check_expert_parallel(o.io.expert_parallel, o.io.tensor_parallel, in.model.config);
    if (!o.quant.empty()) check_qat_model(o, in.model.config);
    if (o.distill.teacher) {
      in.teacher = check_teacher(o.distill, in.model, o.io.tensor_parallel);
    }
    if (o.calib_data) {
      ModelDataOptions calib = o.io;
      calib.data = o.calib_data;
      calib.split = "all";
      in.calib_data = load_checked_data(calib, DataSplit::all, in.model, "train --calib-data");
    }
    if (o.io.sft()) {
      in.sft = load_checked_sft(*o.io.data, o.io, in.model);
    } else {
      in.data = load_checked_data(o.io, DataSplit::train, in.model, "train");
    }
    find_held_out_data(o, in);
    if (in.resumed) check_resumed(o, in);
    if (o.export_quantized) check_export_target(o);
  });
  return in;
}

train::TrainerOptions trainer_options(const TrainOptions& o, std::set<int> fault_steps) {
  train::TrainerOptions t;
  t.steps = o.steps;
  t.global_batch = o.global_batch;
  t.micro_batch = o.micro_batch;
  t.schedule = {o.lr, o.warmup, o.steps, o.min_lr_ratio};
  t.weight_decay = o.weight_decay;
  t.grad_clip = o.grad_clip;
  t.skip_nonfinite = o.skip_nonfinite;
  t.nonfinite_steps = std::move(fault_steps);
  return t;
}

// "1 forward per step", or "4 micro-batches of 2 sequences per step, gradients accumulated".
std::string describe_micro_batches(const train::Trainer& trainer) {
  const std::int64_t count = trainer.micro_batches();
  if (count == 1) return "1 forward per step";
  return std::to_string(count) + " micro-batches of " + std::to_string(trainer.micro_batch()) +
         " sequence" + (trainer.micro_batch() == 1 ? "" : "s") + " per step, gradients accumulated";
}

// The checkpointing --activation-checkpointing and --ac-every ask for (flags already checked).
hf::ActivationCheckpointing activation_checkpointing(const TrainOptions& o) {
  using Mode = hf::ActivationCheckpointingMode;
  const Mode mode = o.activation_checkpointing == "full"        ? Mode::kFull
                    : o.activation_checkpointing == "selective" ? Mode::kSelective
                                                                : Mode::kNone;
  return {.mode = mode, .every = o.ac_every.value_or(2)};
}

// The log's opening lines: layout and model, tokenizer, precision, objective, data, held-out.
void log_start(const TrainOptions& o, const TrainInputs& in, const JobLayout& layout,
               train::Trainer& trainer, const train::SequenceSource& data,
               const std::optional<train::SequenceSource>& held_out) {
  hf::CausalLM& model = trainer.model();
  say("mdist train: " + describe_layout(layout) + ", model " + in.model.description);
  say("mdist train: " + tokenizer_line(in.model));
  if (in.mp_policy) say("mdist train: " + describe_mixed_precision(*in.mp_policy, model));
  if (o.activation_checkpointing != "none") {
    const auto& marked = model->model->checkpointed_layers;
    say("mdist train: activation checkpointing " + o.activation_checkpointing + ": " +
        std::to_string(std::count(marked.begin(), marked.end(), true)) + " of " +
        std::to_string(marked.size()) + " decoder layers recomputed in backward");
  }
  if (model->config.moe) {
    say("mdist train: " + train::describe_aux_loss_weight(model->config, o.router_aux_loss_coef));
  }
  say("mdist train: data " + data.description + ", " + std::to_string(data.count) +
      " sequences of " + std::to_string(o.io.seq_len) + " tokens; global batch " +
      std::to_string(o.global_batch) + " (" + std::to_string(trainer.local_batch()) +
      " per data-parallel rank, " + describe_micro_batches(trainer) + "), steps " +
      std::to_string(trainer.state().step + 1) + ".." + std::to_string(o.steps) +
      (in.resumed ? " (resumed from " + in.resume_from->string() +
                        (o.io.model_dir ? "; --model is only where a fresh run starts" : "") + ")"
       : o.resume == ResumeMode::automatic ? " (--resume auto: no checkpoint yet, starting)"
                                           : ""));
  say(held_out ? "mdist train: held-out loss on " + held_out->description + " (" +
                     std::to_string(o.eval_max_sequences > 0
                                        ? std::min(o.eval_max_sequences, held_out->count)
                                        : held_out->count) +
                     " sequences) " +
                     (o.eval_every ? "every " + std::to_string(*o.eval_every) + " steps"
                                   : std::string("at each checkpoint"))
               : std::string("mdist train: no held-out loss (") +
                     (o.eval_every ? "--eval-every 0"
                                   : "no held-out data: --eval-data or --split train") +
                     ")");
}

// The run's loop: steps, their metrics and progress, held-out losses and checkpoints.
void run_steps(const TrainOptions& o, train::Trainer& trainer,
               const std::optional<train::SequenceSource>& held_out,
               std::optional<train::MetricsWriter>& metrics, const std::vector<fs::path>& carried) {
  Progress progress(stdout, o.log_every);
  StepWatchdog watchdog(std::chrono::milliseconds(static_cast<int64_t>(o.watchdog_s * 1000)));
  const train::StepMetricsFields fields{.aux_loss = trainer.loss().reports_aux_loss(),
                                        .aux_loss_weight = trainer.loss().aux_loss_weight(),
                                        .all_to_all_bytes = o.io.expert_parallel > 1,
                                        .skipped = o.skip_nonfinite,
                                        .distillation = trainer.loss().reports_distillation()};
  const auto started = std::chrono::steady_clock::now();
  int steps_here = 0;
  while (!trainer.done()) {
    watchdog.reached(trainer.state().step + 1);
    train::StepStats stats;
    try {
      stats = trainer.step();
    } catch (const train::NonFiniteStep& error) {
      progress.finish();
      const auto last = train::latest_checkpoint(o.out);
      throw AgreedFailure(
          std::string(error.what()) + ", nothing saved (" +
              (last ? "the last checkpoint is " + last->string() : std::string("no checkpoint")) +
              "). Lower --lr, or pass --skip-nonfinite-steps to skip such steps",
          rank() == 0, 1);
    }
    ++steps_here;
    const int step = stats.step;
    if (metrics) {
      metrics->write(train::step_metrics(stats, fields, trainer.state().skipped_steps));
      progress.update(
          {.step = step,
           .total_steps = o.steps,
           .loss = stats.loss,
           .lr = stats.lr,
           .tokens_per_s = stats.tokens_per_s,
           .elapsed_s =
               std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
           .steps_done_here = steps_here,
           .peak_rss_mib = stats.peak_rss_mib});
    }
    const bool save = (o.save_every > 0 && step % o.save_every == 0) || step == o.steps;
    const bool evaluate =
        held_out && (o.eval_every ? (step % *o.eval_every == 0 || step == o.steps) : save);
    if (evaluate) {
      const train::HeldOutLoss held = trainer.evaluate(*held_out, o.eval_max_sequences);
      if (metrics) {
        metrics->write(train::eval_metrics(step, held));
        progress.note("mdist train: step " + std::to_string(step) + ": held-out loss " +
                      format_number("%.4f", held.mean()) + ", perplexity " +
                      format_number("%.3f", std::exp(held.mean())));
      }
    }
    if (save) trainer.save(o.out, o.keep, carried);
  }
  progress.finish();
}

// Rank 0: the loss plot and the closing line.
void finish(const TrainOptions& o, const TrainInputs& in, const train::Trainer& trainer,
            train::MetricsWriter& metrics) {
  metrics.close();
  const auto points = train::metric_points(metrics.path(), "loss");
  io::write_file_atomically(o.out / "loss.svg",
                            loss_curve_svg(points, "mdist train: " + data_description(in),
                                           train::metric_points(metrics.path(), "eval_loss")));
  const int skipped = trainer.state().skipped_steps;
  say("mdist train: done; final loss " +
      format_number("%.4f", points.empty() ? 0.0 : points.back().second) +
      (skipped > 0 ? " (" + std::to_string(skipped) + " non-finite step(s) skipped)"
                   : std::string()) +
      ". Wrote " + metrics.path().string() + ", " + (o.out / "loss.svg").string() +
      " and checkpoint " + (o.out / "checkpoints").string() + "/" + "latest");
}

}  // namespace

int run_train(const TrainOptions& o) {
  const Session session(setup_options(o.io.timeout_s));
  configure_threads();
  const TrainInputs in = check_inputs(o);
  for (const auto& warning : in.warnings) say("mdist train: warning: " + warning);
  if (in.already_complete) {
    say("mdist train: the run in " + o.out.string() + " is already complete (" +
        in.resume_from->string() + " is at step " + std::to_string(in.resumed->step) +
        " of --steps " + std::to_string(o.steps) + "); nothing to do, nothing written" +
        (o.export_quantized ? " (its export: mdist quantize --from-run " + o.out.string() + ")"
                            : std::string()));
    return 0;
  }
  // The sequences: windows of the token stream, or the SFT examples' rows; each source reads
  // from what it was made of, which lives here until the run ends.
  std::optional<Windows> windows, held_out_windows;
  train::SequenceSource data;
  std::optional<train::SequenceSource> held_out;
  if (in.sft) {
    data = sft_source(*in.sft, std::make_shared<WindowOrder>(in.sft->rows(), o.io.seed));
    if (in.held_out_sft) held_out = sft_source(*in.held_out_sft);
  } else {
    windows.emplace(in.data, o.io.seq_len, "train");
    data = sequence_source(*windows, in.data.description,
                           std::make_shared<WindowOrder>(windows->count(), o.io.seed));
    if (in.held_out_data) {
      held_out_windows.emplace(*in.held_out_data, o.io.seq_len, "train (held out)");
      held_out = sequence_source(*held_out_windows, in.held_out_data->description);
    }
  }
  const JobLayout layout = make_layout(o.io.tensor_parallel, o.io.expert_parallel);
  hf::ParallelModel built =
      build_wrapped_model(in.model, o.io.seed, layout, in.mp_policy, activation_checkpointing(o));
  // --quant: the quantizers, calibrated before anything is written (a calibration that fails
  // leaves the run directory as it was); they outlive the trainer, whose forwards they hook.
  std::unique_ptr<quant::ModelQuantizers> quantizers;
  std::string qat_line;
  if (!o.quant.empty() && in.resumed) {
    quantizers =
        resume_quantization_aware_training(o, built.model, built.parallelism, *in.resume_from);
    qat_line = "mdist train: quantization-aware training, --quant " + o.quant +
               ": the quantizers of " + (*in.resume_from / kQatStateFile).string() +
               " (amax as calibrated when the run started), backward " + o.quant_backward;
  } else if (!o.quant.empty() && in.model.quantization) {
    quantizers = start_qat_from_export(o, built.model, built.parallelism, *in.model.dir);
    qat_line = "mdist train: quantization-aware training, --quant " + o.quant +
               ": the quantizers of the export " + in.model.dir->string() +
               " (amax = its weight_scale / input_scale x maxbound, no calibration), backward " +
               o.quant_backward;
  } else if (!o.quant.empty()) {
    std::optional<Windows> calib_windows;
    if (in.calib_data) calib_windows.emplace(*in.calib_data, o.io.seq_len, "train --calib-data");
    const Windows& calib = calib_windows ? *calib_windows : *windows;
    const QatCalibration calibration{
        .windows = calib,
        .description = in.calib_data ? in.calib_data->description : in.data.description,
        .sequences = calibration_sequences(o, calib)};
    // Timed so that its cost can be told apart from the steps' (bench/train_cli.sh's QAT rows).
    const auto calibration_start = std::chrono::steady_clock::now();
    quantizers =
        start_quantization_aware_training(o, built.model, built.parallelism, layout, calibration);
    const double calibration_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - calibration_start).count();
    std::ostringstream seconds;
    seconds.precision(3);
    seconds << std::fixed << calibration_s;
    qat_line = "mdist train: quantization-aware training, --quant " + o.quant + " (" +
               qat_config(o).name + " preset, " + qat_calibration_method(o) +
               " calibration on the first " + std::to_string(calibration.sequences) +
               " sequences of " + calibration.description + " in " + seconds.str() +
               " s, amax frozen from step 1), backward " + o.quant_backward;
  }
  const double aux_weight = train::aux_loss_weight(built.model->config, o.router_aux_loss_coef);
  // --teacher: the teacher built on the same layout, before anything is written.
  std::unique_ptr<train::LossFunction> loss;
  if (in.teacher) {
    loss = make_distillation_loss(o.distill, *in.teacher, built.model->config, aux_weight,
                                  o.io.seed, layout, in.mp_policy);
  } else {
    loss = std::make_unique<train::CausalLmLoss>(built.model->config, aux_weight);
  }
  // The run directory is this job's from here on (rank 0 holds the lock; a second job into
  // the same directory gets one line naming this one's pid). Taken once the model is known to
  // be good, so that a bad checkpoint leaves no lock file behind; the earlier run goes only now.
  std::unique_ptr<RunLock> lock;
  agree_on_inputs([&] {
    if (rank() == 0) lock = std::make_unique<RunLock>(o.out);
  });
  if (rank() == 0 && in.replace_earlier) remove_earlier_run(o.out);
  const hf::Parallelism built_parallelism = built.parallelism;  // the trainer takes `built`
  train::Trainer trainer(std::move(built), layout.parallel, data,
                         trainer_options(o, in.fault_steps), std::move(loss),
                         run_flags(o, data_description(in), in.model));
  if (rank() == 0) fs::create_directories(o.out);
  // The quantizers' state, frozen for the run: in the run directory, copied into every
  // checkpoint beside the tokenizer files.
  const std::vector<fs::path> carried_tokenizer = tokenizer_files(in.model);
  std::vector<fs::path> carried = carried_tokenizer;
  if (quantizers) {
    save_qat_state(*quantizers, built_parallelism, o, o.out / kQatStateFile);
    carried.push_back(o.out / kQatStateFile);
  }
  if (in.resumed) trainer.resume(*in.resume_from, *in.resumed);
  std::optional<train::MetricsWriter> metrics;
  if (rank() == 0) {
    metrics.emplace(o.out / "metrics.jsonl",
                    in.resumed ? std::optional<int>(trainer.state().step) : std::nullopt);
  }
  log_start(o, in, layout, trainer, data, held_out);
  if (!qat_line.empty()) say(qat_line);
  if (in.teacher) say(describe_distillation_run(o.distill, *in.teacher));
  run_steps(o, trainer, held_out, metrics, carried);
  if (o.export_quantized) {
    // The trained weights with the quantizers as calibrated before step 1: no calibration.
    write_quantized_export(trainer.model(), *quantizers, built_parallelism, carried_tokenizer,
                           *o.export_quantized);
    say("mdist train: wrote " + o.export_quantized->string() + " (unified HF checkpoint, --quant " +
        o.quant + ", amax as calibrated before step 1)");
  }
  if (metrics) finish(o, in, trainer, *metrics);
  return 0;
}

}  // namespace mdist::cli
