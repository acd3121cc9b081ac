#pragma once
// `mdist train`'s options: each flag's default (here), its name and help
// (declare_train_flags) and its validation (check_train_flags), in one place.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "src/cli/distill_options.h"
#include "src/cli/flags.h"

namespace mdist::cli {

// --resume: off (a fresh run), always (bare --resume: continue, a checkpoint must exist), or
// automatic (--resume auto: continue when the run directory has a checkpoint, else start; the
// same command line then serves every restart of a job).
enum class ResumeMode { off, always, automatic };

struct TrainOptions {
  ModelDataOptions io;
  std::filesystem::path out = "runs/default";
  int steps = 300;
  std::int64_t global_batch = 16;
  // --micro-batch: sequences per data-parallel rank per forward (gradient accumulation);
  // nullopt: the rank's whole share of the global batch in one forward.
  std::optional<std::int64_t> micro_batch;
  double lr = 3e-3;
  double min_lr_ratio = 0.1;
  int warmup = 30;
  double weight_decay = 0.1;
  double grad_clip = 1.0;
  int save_every = 100;  // 0: only at the end
  int keep = 2;          // checkpoints kept (the newest)
  int log_every = 10;
  ResumeMode resume = ResumeMode::off;
  bool overwrite = false;       // replace an earlier run in `out` (never the --model source)
  bool skip_nonfinite = false;  // skip a step whose loss or gradient norm is not finite
  // Held-out loss every K steps; nullopt: at each checkpoint; 0: never.
  std::optional<int> eval_every;
  std::optional<std::filesystem::path> eval_data;  // else the eval split of the training data
  std::int64_t eval_max_sequences = 256;           // 0: all
  double watchdog_s = 300;  // report a rank that lags the others' step this long (0: never)
  // --router-aux-loss-coef: the weight of a mixture of experts' load-balancing loss in the
  // objective. nullopt: the config's (router_aux_loss_coef when output_router_logits is true,
  // else none, as transformers); 0: none; else this weight.
  std::optional<double> router_aux_loss_coef;
  // --activation-checkpointing none|full|selective (validated by check_train_flags) and
  // selective's --ac-every K (default 2, as torchtitan's selective_ac_option).
  std::string activation_checkpointing = "none";
  std::optional<std::int64_t> ac_every;
  std::string resume_flag;  // --resume as given ("" when absent); sets `resume` after parsing
  // Quantization-aware training (docs/quantization.md): --quant fp8|int8|int4_awq|nvfp4
  // ("" : off), with --kv-cache fp8 the attention's keys and values too, calibrated
  // once before step 1 on --calib-sequences windows (0: all) of --calib-data (default: the
  // training data's first windows in file order); --quant-backward: modelopt's
  // pass_through_bwd (pass-through, its default) or the clipped STE. A resumed QAT run takes its
  // checkpoint's quantizers and must repeat these flags.
  std::string quant;
  std::int64_t calib_sequences = 64;
  std::optional<std::filesystem::path> calib_data;
  std::string quant_backward = "pass-through";
  std::string kv_cache;  // --kv-cache ("": keys and values unquantized)
  // --export-quantized DIR: with --quant, the unified HF checkpoint of the trained model and its
  // frozen quantizers written after the last step (src/cli/qat_export.h).
  std::optional<std::filesystem::path> export_quantized;
  bool calib_sequences_given = false;  // set after parsing: --calib-sequences was on the line
  bool quant_backward_given = false;   // set after parsing: --quant-backward was on the line
  // Knowledge distillation (--teacher, src/cli/distill_options.h).
  DistillOptions distill;
};

void declare_train_flags(CLI::App& app, TrainOptions& options);
// The flags alone (ranges, exclusions, sizes against the world of `world` ranks), in the order
// they are reported: InputError naming the first bad one.
void check_train_flags(const TrainOptions& options, int world);
// The --quant flags alone (part of check_train_flags).
void check_quant_flags(const TrainOptions& options);

}  // namespace mdist::cli
