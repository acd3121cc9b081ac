#pragma once
// `mdist tokenize`'s options: each flag's default (here), its name and help
// (declare_tokenize_flags).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "src/cli/flags.h"

namespace mdist::cli {

struct TokenizeOptions {
  std::filesystem::path model_dir;  // holds tokenizer.json
  std::filesystem::path data;
  std::filesystem::path out;    // .u16 or .u32
  std::string format = "text";  // text, jsonl or sft
  std::string field = "text";   // jsonl: the text's field
  // sft: the JSON fields of the prompt and the completion (as train / eval --format sft).
  std::string prompt_field = "prompt";
  std::string completion_field = "completion";
  std::string sample_by = "line";  // text: line, paragraph or document
  std::optional<double> timeout_s;
};

void declare_tokenize_flags(CLI::App& app, TokenizeOptions& options);

}  // namespace mdist::cli
