#pragma once
// `mdist info`'s options: each flag's default (here), its name and help (declare_info_flags).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "src/cli/flags.h"

namespace mdist::cli {

struct InfoOptions {
  int tensor_parallel = 1;
  int expert_parallel = 1;
  std::optional<double> timeout_s;
};

void declare_info_flags(CLI::App& app, InfoOptions& options);

}  // namespace mdist::cli
