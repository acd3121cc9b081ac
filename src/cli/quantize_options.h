#pragma once
// `mdist quantize`'s options: each flag's default (here), its name and help
// (declare_quantize_flags).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <set>
#include <string>

#include "src/cli/flags.h"

namespace mdist::cli {

struct QuantizeOptions {
  // --model, --data (calibration), --seq-len, --tp, ... as calibrate takes them.
  ModelDataOptions io;
  std::string format;                              // --format: fp8 | int8 (required)
  std::string kv_cache;                            // --kv-cache: fp8 (FP8_KV_CFG) or empty
  std::optional<double> sq_alpha;                  // --sq-alpha: int8_sq's alpha (default 1.0)
  std::int64_t calib_sequences = 64;               // 0: all windows of the calibration data
  std::optional<std::filesystem::path> eval_data;  // held-out data (default: as `mdist eval`)
  std::int64_t eval_sequences = 0;                 // 0: all held-out windows
  std::int64_t batch_size = 8;                     // held-out sequences per forward on each rank
  std::optional<std::filesystem::path> out;        // the export's directory (required)
  std::filesystem::path default_run = "runs/default";
  // --from-run RUN: export a quantization-aware training run (its directory or one of its
  // checkpoints) with its own quantizers instead of calibrating (src/cli/qat_export.h).
  std::optional<std::filesystem::path> from_run;
  std::set<std::string> given;  // set after parsing: the options on the command line ("--data")
};

void declare_quantize_flags(CLI::App& app, QuantizeOptions& options);

}  // namespace mdist::cli
