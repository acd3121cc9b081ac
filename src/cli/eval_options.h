#pragma once
// `mdist eval`'s options: each flag's default (here), its name and help (declare_eval_flags).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "src/cli/flags.h"

namespace mdist::cli {

struct EvalOptions {
  ModelDataOptions io;
  std::int64_t batch_size = 8;               // sequences per forward on each rank
  std::optional<std::filesystem::path> out;  // JSON result
  std::filesystem::path default_run = "runs/default";
};

void declare_eval_flags(CLI::App& app, EvalOptions& options);

}  // namespace mdist::cli
