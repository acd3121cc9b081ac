#pragma once
// `mdist generate`'s options: each flag's default (here), its name and help
// (declare_generate_flags).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "src/cli/flags.h"

namespace mdist::cli {

struct GenerateOptions {
  std::optional<std::filesystem::path> model_dir;
  // --prompt (repeatable) and --prompts FILE (one a line) together; neither: kDefaultPrompt.
  std::vector<std::string> prompts;
  std::optional<std::filesystem::path> prompts_file;
  // 200 new bytes after the default prompt fit the default model's 256 positions.
  int max_new_tokens = 200;
  double temperature = 0.8;
  int top_k = 40;
  double top_p = 1.0;
  bool greedy = false;
  std::uint64_t seed = 1234;
  int tensor_parallel = 1;
  std::optional<double> timeout_s;
  std::string param_dtype;  // as ModelDataOptions::param_dtype
  std::filesystem::path default_run = "runs/default";
};

inline constexpr const char* kDefaultPrompt = "MACBETH.\n";

void declare_generate_flags(CLI::App& app, GenerateOptions& options);

}  // namespace mdist::cli
