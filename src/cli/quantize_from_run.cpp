// See src/cli/quantize_from_run.h.
#include "src/cli/quantize_from_run.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <chrono>

#include "mdist/runtime/runtime.h"
#include "src/cli/export_dir.h"
#include "src/cli/job.h"
#include "src/cli/qat_export.h"
#include "src/cli/train_quant.h"

namespace mdist::cli {
namespace {

using json = nlohmann::ordered_json;

// The flags a calibration or a held-out loss would read: with --from-run there is neither.
constexpr const char* kCalibrationFlags[] = {"--model",     "--data",           "--data-format",
                                             "--split",     "--seq-len",        "--seed",
                                             "--sq-alpha",  "--kv-cache",       "--calib-sequences",
                                             "--eval-data", "--eval-sequences", "--batch-size"};

struct FromRunInputs {
  QatRun run;
  ModelChoice choice;
};

FromRunInputs check_inputs(const QuantizeOptions& o) {
  FromRunInputs in;
  agree_on_inputs([&] {
    for (const char* flag : kCalibrationFlags) {
      if (o.given.contains(flag)) {
        throw InputError(std::string(flag) +
                         " does not apply to --from-run: the run's weights and quantizers are "
                         "exported as trained, without calibration or a held-out loss");
      }
    }
    if (!o.out) throw InputError("--out DIR is required: the directory the export is written to");
    check_export_dir(*o.out, "--out");
    if (!o.io.param_dtype.empty()) {
      throw InputError(
          "--param-dtype is not supported by quantize: the model is exported in its "
          "weights' dtype");
    }
    if (o.io.expert_parallel != 1) {
      throw InputError("--ep " + std::to_string(o.io.expert_parallel) +
                       ": quantize does not support expert parallelism yet");
    }
    check_tensor_parallel_size(o.io.tensor_parallel);
    in.run = find_qat_run(*o.from_run, "--from-run");
    if (!o.format.empty() && o.format != in.run.format) {
      throw InputError("--format " + o.format + " disagrees with --from-run: " +
                       in.run.checkpoint.string() + " was trained with --quant " + in.run.format +
                       " (the format comes from the run; leave --format out)");
    }
    in.choice = model_from_dir(in.run.checkpoint);
    check_not_quantized(in.choice, "quantize");
    check_tensor_parallel(o.io.tensor_parallel, in.choice.config);
  });
  return in;
}

}  // namespace

int run_quantize_from_run(const QuantizeOptions& o) {
  const Session session(setup_options(o.io.timeout_s));
  configure_threads();
  const FromRunInputs in = check_inputs(o);
  const auto start = std::chrono::steady_clock::now();
  const JobLayout layout = make_layout(o.io.tensor_parallel);
  const hf::ParallelModel built = build_wrapped_model(in.choice, o.io.seed, layout);
  hf::CausalLM model = built.model;
  model->eval();
  const torch::NoGradGuard no_grad;
  say("mdist quantize: model " + in.choice.description);
  say("mdist quantize: from the quantization-aware run " + o.from_run->string() + ": --quant " +
      in.run.description + "; its quantizers as calibrated (" +
      (in.run.checkpoint / kQatStateFile).string() + "), no calibration, " +
      describe_layout(layout));
  // The quantizers exactly as a resumed run of it inserts them (train_quant.h): its format's
  // preset, the amax of the checkpoint's state file. The backward does not matter here.
  TrainOptions run;
  run.quant = in.run.format;
  run.kv_cache = in.run.kv_cache;
  const auto quantizers =
      resume_quantization_aware_training(run, model, built.parallelism, in.run.checkpoint);
  const int tp = layout.tensor_parallel();
  const json report = {
      {"format", "mdist.quantize.v1"},
      {"quant_format", in.run.format},
      {"calibration", nullptr},
      {"from_run", o.from_run->string()},
      {"checkpoint", in.run.checkpoint.string()},
      {"qat", in.run.description},
      {"model", in.choice.description},
      {"layout",
       {{"world", mdist::size()},
        {"data_parallel", mdist::size() / tp},
        {"tensor_parallel", tp},
        {"description", describe_layout(layout)}}},
      {"seconds",
       {{"total",
         std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()}}}};
  write_quantized_export(model, *quantizers, built.parallelism, tokenizer_files(in.choice), *o.out,
                         report.dump(2) + "\n");
  say("mdist quantize: wrote " + o.out->string() + " (unified HF checkpoint, quantize.json)");
  return 0;
}

}  // namespace mdist::cli
