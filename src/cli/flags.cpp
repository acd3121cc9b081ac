// See src/cli/flags.h.
#include "src/cli/flags.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "mdist/error.h"

namespace mdist::cli {
namespace {

constexpr const char* kTpHelp =
    "Tensor-parallel size: the model is split over groups of this many consecutive ranks "
    "(Megatron style) and the data over world / tp data-parallel ranks";

constexpr const char* kEpHelp =
    "Expert-parallel size: each mixture-of-experts layer's experts are split over groups of "
    "this many data-parallel ranks (Megatron style: dp = ep x expert-data-parallel), tokens "
    "sent to their experts' ranks by all-to-all";

}  // namespace

void declare_tensor_parallel_flag(CLI::App& app, int& tp) {
  app.add_option("--tp", tp, kTpHelp)->capture_default_str();
}

void declare_expert_parallel_flag(CLI::App& app, int& ep) {
  app.add_option("--ep", ep, kEpHelp)->capture_default_str();
}

void declare_timeout_flag(CLI::App& app, std::optional<double>& timeout_s) {
  app.add_option("--timeout", timeout_s,
                 "Seconds a collective may wait for the other ranks before the job fails "
                 "(default: MDIST_TIMEOUT, else 1800)")
      ->type_name("SECONDS");
}

void declare_param_dtype_flag(CLI::App& app, std::string& param_dtype) {
  app.add_option("--param-dtype", param_dtype,
                 "Mixed precision (FSDP2's param_dtype): gather and compute in bf16 (or fp32); "
                 "in training, gradients are reduced in fp32 and the weights and AdamW state "
                 "keep their dtype (default: compute in the weights' dtype)")
      ->type_name("DTYPE");
}

void declare_model_data_flags(CLI::App& app, ModelDataOptions& io, bool with_model) {
  if (with_model) {
    app.add_option("--model", io.model_dir,
                   "Hugging Face model directory (config.json + safetensors)")
        ->type_name("DIR");
  }
  app.add_option("--data", io.data, "Data file (default: the embedded corpus)")->type_name("FILE");
  app.add_option("--data-format", io.data_format,
                 "text (through the model's tokenizer.json, else one token per byte), ids "
                 "(whitespace-separated decimal ids), u16, u32 or i32 (little-endian binary, "
                 "memory-mapped), or auto (by extension: .ids, .u16/.bin, .u32, .i32, else text)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "text", "ids", "u16", "u32", "i32"}));
  app.add_option("--split", io.split,
                 "Part of the data: all, train (first 90%), eval (last 10%); auto: the "
                 "command's split of the embedded corpus, all of a --data file")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "all", "train", "eval"}));
  app.add_option("--seq-len", io.seq_len, "Tokens per sequence")->capture_default_str();
  app.add_option("--seed", io.seed, "Seed of the initialisation and the data order")
      ->capture_default_str();
  declare_tensor_parallel_flag(app, io.tensor_parallel);
  declare_expert_parallel_flag(app, io.expert_parallel);
  declare_timeout_flag(app, io.timeout_s);
  declare_param_dtype_flag(app, io.param_dtype);
}

void declare_sft_flags(CLI::App& app, ModelDataOptions& io) {
  app.add_option("--format", io.format,
                 "lm (language modelling on the --data stream) or sft (a JSON Lines --data "
                 "file of prompt / completion pairs: loss on the completion tokens only)")
      ->capture_default_str();
  app.add_option("--prompt-field", io.prompt_field, "--format sft: the prompt's JSON field")
      ->capture_default_str();
  app.add_option("--completion-field", io.completion_field,
                 "--format sft: the completion's JSON field")
      ->capture_default_str();
  app.add_flag("--packing", io.packing,
               "--format sft: several examples per sequence (per-example positions and "
               "attention), instead of one padded example per sequence");
}

void check_sft_flags(const ModelDataOptions& io) {
  if (io.format != "lm" && io.format != "sft") {
    throw InputError("unknown --format '" + io.format + "' (expected lm or sft)");
  }
  if (!io.sft()) {
    if (io.packing) throw InputError("--packing needs --format sft");
    if (io.prompt_field != "prompt" || io.completion_field != "completion") {
      throw InputError("--prompt-field and --completion-field need --format sft");
    }
    return;
  }
  if (!io.data) throw InputError("--format sft needs --data FILE.jsonl");
  if (io.split == "train" || io.split == "eval") {
    throw InputError("--split " + io.split +
                     " does not apply to --format sft (held-out examples: --eval-data)");
  }
  if (io.prompt_field.empty() || io.completion_field.empty()) {
    throw InputError("--prompt-field and --completion-field must not be empty");
  }
}

std::string flag_value(double value) {
  if (std::isnan(value)) return "nan";
  char text[64];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

void check_positive(double value, const char* flag) {
  if (!std::isfinite(value) || !(value > 0)) {
    throw InputError(std::string(flag) + " must be a positive number, got " + flag_value(value));
  }
}

void check_non_negative(double value, const char* flag) {
  if (!std::isfinite(value) || !(value >= 0)) {
    throw InputError(std::string(flag) + " must be a finite number >= 0, got " + flag_value(value));
  }
}

void check_at_least(std::int64_t value, std::int64_t least, const char* flag) {
  if (value < least) {
    throw InputError(std::string(flag) + " must be at least " + std::to_string(least) + ", got " +
                     std::to_string(value));
  }
}

void check_tensor_parallel_size(int tp, int world) {
  if (tp < 1) throw InputError("--tp must be at least 1, got " + std::to_string(tp));
  if (world % tp != 0) {
    throw InputError("--tp " + std::to_string(tp) + " does not divide the world size " +
                     std::to_string(world));
  }
}

void check_expert_parallel_size(int ep, int tp, int world) {
  if (ep < 1) throw InputError("--ep must be at least 1, got " + std::to_string(ep));
  // Expert-parallel groups are carved out of the data-parallel dimension.
  const int dp = std::max(1, world) / std::max(1, tp);
  if (dp % ep != 0) {
    throw InputError("--ep " + std::to_string(ep) + " does not divide the data-parallel size " +
                     std::to_string(dp) + " (world " + std::to_string(std::max(1, world)) +
                     " / tp " + std::to_string(tp) + ")");
  }
}

}  // namespace mdist::cli
