#pragma once
// `mdist generate`'s options: each flag's default (here), its name and help
// (declare_generate_flags).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "src/cli/flags.h"

namespace mdist::cli {

struct GenerateOptions {
  std::optional<std::filesystem::path> model_dir;
  std::string prompt = "MACBETH.\n";
  int max_new_tokens = 300;
  double temperature = 0.8;
  int top_k = 40;
  bool greedy = false;
  std::uint64_t seed = 1234;
  int tensor_parallel = 1;
  std::optional<double> timeout_s;
  std::string param_dtype;  // as ModelDataOptions::param_dtype
  std::filesystem::path default_run = "runs/default";
};

void declare_generate_flags(CLI::App& app, GenerateOptions& options);

}  // namespace mdist::cli
