#pragma once
// Which model a command runs on: a Hugging Face directory (or a training run standing for its
// latest checkpoint) or the embedded default config, with its tokenizer.
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/quantized_checkpoint.h"
#include "mdist/hf/tokenizer.h"

namespace mdist::cli {

// The shipped defaults (compiled into the binary, see src/cli/embedded_data.cmake).
std::string_view embedded_config_json();
std::string_view embedded_corpus();
inline constexpr const char* kEmbeddedCorpusName = "data/corpus/macbeth.txt";

// The model a command runs on: a Hugging Face directory, or the embedded default config with a
// seeded initialisation.
struct ModelChoice {
  std::optional<std::filesystem::path> dir;
  hf::LlamaConfig config;
  std::string description;  // for the log
  // The directory's tokenizer.json (with tokenizer_config.json), if it has one: text data is
  // then tokenized with it, and generate encodes and decodes with it.
  std::shared_ptr<const hf::Tokenizer> tokenizer;
  // A quantized checkpoint's format (config.json's quantization_config): eval and generate read
  // it back as the quantized model (checkpoint_quantizers); train, calibrate and quantize
  // refuse it (check_not_quantized).
  std::optional<hf::CheckpointQuantization> quantization;
};

// InputError unless `model` is an unquantized checkpoint (or none): `command` works on the
// model's own weights, which a quantized checkpoint no longer holds.
void check_not_quantized(const ModelChoice& model, const char* command);

// DIR's tokenizer (InputError naming the directory and the problem when tokenizer.json is
// malformed or unsupported); null when DIR has no tokenizer.json, or an InputError when
// `required`.
std::shared_ptr<const hf::Tokenizer> tokenizer_of(const std::filesystem::path& dir, bool required);
// "tokenizer: <description>" or "tokenizer: none, text read as bytes", for the log.
std::string tokenizer_line(const ModelChoice& model);
// The tokenizer files of the model's directory that a checkpoint carries along.
std::vector<std::filesystem::path> tokenizer_files(const ModelChoice& model);

// Checks a model directory (exists, readable, config.json of a supported architecture,
// safetensors present and valid); throws InputError naming the problem. A run directory of
// `mdist train` (RUN, or RUN/checkpoints/latest) stands for the run's latest checkpoint
// (resume_point: a damaged one is refused), which the description names.
ModelChoice model_from_dir(const std::filesystem::path& dir);
ModelChoice default_model();
// `dir` if given; else the latest checkpoint of `default_run` (a default `mdist train`) if there
// is one; else the embedded default.
ModelChoice model_for_inference(const std::optional<std::filesystem::path>& dir,
                                const std::filesystem::path& default_run);

}  // namespace mdist::cli
