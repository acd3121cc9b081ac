#pragma once
// What the subcommands' flags share: the model-and-data options several subcommands take, the
// declarations of the flags that mean the same everywhere (--tp, --ep, --timeout,
// --param-dtype), and the numeric checks every subcommand's validation uses. Each
// subcommand's own flags are declared next to its options struct (src/cli/*_options.h).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace CLI {
class App;
}

namespace mdist::cli {

// Where the model and the data come from. Empty model_dir: the embedded default (see each
// command); empty data: the embedded corpus.
struct ModelDataOptions {
  std::optional<std::filesystem::path> model_dir;
  std::optional<std::filesystem::path> data;
  std::string data_format = "auto";
  std::string split = "auto";  // auto: train/eval split of the embedded corpus, else "all"
  std::int64_t seq_len = 128;
  std::uint64_t seed = 1234;
  int tensor_parallel = 1;          // --tp: ranks per tensor-parallel group (dp = world / tp)
  int expert_parallel = 1;          // --ep: ranks per expert-parallel group (carved out of dp)
  std::optional<double> timeout_s;  // --timeout (else MDIST_TIMEOUT, else 30 min)
  // --param-dtype: empty (compute in the weights' dtype), or the dtype FSDP2's mixed precision
  // gathers and computes in (parse_param_dtype). The same in train, eval and calibrate, so a
  // held-out loss logged by train is what eval gives for the checkpoint.
  std::string param_dtype;
  // --format: lm (a token stream cut into windows of seq_len) or sft (prompt / completion
  // examples of a JSON Lines --data file, src/cli/sft_data.h), with its field names and
  // --packing. train and eval only.
  std::string format = "lm";
  std::string prompt_field = "prompt";
  std::string completion_field = "completion";
  bool packing = false;
  bool sft() const { return format == "sft"; }
};

// --model (when with_model), --data, --data-format, --split, --seq-len, --seed, --tp, --ep,
// --timeout, --param-dtype.
void declare_model_data_flags(CLI::App& app, ModelDataOptions& io, bool with_model = true);
// --format, --prompt-field, --completion-field, --packing (train and eval).
void declare_sft_flags(CLI::App& app, ModelDataOptions& io);
// InputError unless --format is lm or sft, and the SFT flags come with --format sft and --data.
void check_sft_flags(const ModelDataOptions& io);
void declare_tensor_parallel_flag(CLI::App& app, int& tp);
void declare_expert_parallel_flag(CLI::App& app, int& ep);
void declare_timeout_flag(CLI::App& app, std::optional<double>& timeout_s);
void declare_param_dtype_flag(CLI::App& app, std::string& param_dtype);

// Numeric flags: InputError naming the flag and the value unless it is finite and in range.
void check_positive(double value, const char* flag);      // finite and > 0
void check_non_negative(double value, const char* flag);  // finite and >= 0
void check_at_least(std::int64_t value, std::int64_t least, const char* flag);
// --tp: at least 1 and dividing the world size.
void check_tensor_parallel_size(int tp, int world);
// --ep: at least 1 and dividing the data-parallel size world / tp (expert-parallel groups are
// carved out of the data-parallel dimension).
void check_expert_parallel_size(int ep, int tp, int world);
// "%g" of a flag's value, for messages.
std::string flag_value(double value);

}  // namespace mdist::cli
