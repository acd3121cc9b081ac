#pragma once
// `mdist calibrate`'s options: each flag's default (here), its name and help
// (declare_calibrate_flags).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "src/cli/flags.h"

namespace mdist::cli {

struct CalibrateOptions {
  ModelDataOptions io;
  std::int64_t max_sequences = 64;  // 0: all
  std::filesystem::path out = "runs/default/calibration.json";
  std::filesystem::path default_run = "runs/default";
  // Write the JSON although some routed experts got no calibration tokens (reported).
  bool allow_incomplete_moe = false;
};

void declare_calibrate_flags(CLI::App& app, CalibrateOptions& options);

}  // namespace mdist::cli
