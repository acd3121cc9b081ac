#include "src/cli/model_choice.h"

#include <fstream>

#include <nlohmann/json.hpp>

#include "mdist/hf/pretrained.h"
#include "mdist/hf/safetensors.h"
#include "mdist/train/checkpoint.h"
#include "src/cli/input_error.h"

namespace mdist::cli {

namespace {

// A run directory of `mdist train` (checkpoints/, no config.json) or its checkpoints/latest
// pointer, as a user types them for --model: the run's latest checkpoint, and how it was found.
std::optional<std::pair<std::filesystem::path, std::string>> run_checkpoint(
    const std::filesystem::path& given) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path run;
  if (fs::is_regular_file(given, ec) && given.filename() == "latest" &&
      given.parent_path().filename() == "checkpoints") {
    run = given.parent_path().parent_path();
  } else if (fs::is_directory(given, ec) && !fs::exists(given / "config.json", ec) &&
             fs::is_directory(given / "checkpoints", ec)) {
    run = given;
  } else {
    return std::nullopt;
  }
  const train::ResumePoint point = train::resume_point(run);
  if (!point.checkpoint) {
    throw InputError("--model '" + given.string() + "': the run '" + run.string() +
                     "' has no complete checkpoint yet");
  }
  std::string how = "the latest checkpoint of the run " + run.string();
  for (const auto& warning : point.warnings) how += "; warning: " + warning;
  return std::pair{*point.checkpoint, how};
}

}  // namespace

ModelChoice model_from_dir(const std::filesystem::path& given) {
  if (const auto found = run_checkpoint(given)) {
    ModelChoice choice = model_from_dir(found->first);
    choice.description =
        found->first.string() + " (" + choice.config.architecture + "; " + found->second + ")";
    return choice;
  }
  const std::filesystem::path& dir = given;
  std::error_code ec;
  const auto status = std::filesystem::status(dir, ec);
  if (!std::filesystem::exists(status)) {
    throw InputError("model directory '" + dir.string() + "' does not exist");
  }
  if (!std::filesystem::is_directory(status)) {
    throw InputError("model directory '" + dir.string() + "' is not a directory");
  }
  const auto config_path = dir / "config.json";
  if (!std::filesystem::exists(config_path, ec)) {
    throw InputError("model directory '" + dir.string() + "' has no config.json");
  }
  if (std::ifstream probe(config_path); !probe) {
    throw InputError("model directory '" + dir.string() +
                     "': cannot read config.json: " + std::strerror(errno));
  }
  ModelChoice choice;
  choice.dir = dir;
  try {
    choice.config = hf::LlamaConfig::from_file(config_path.string());
    choice.quantization = hf::checkpoint_quantization(dir);
    // Opens and validates every safetensors file (and the index) up front.
    // and checks them against the config (names, full shapes, dtypes), as from_pretrained.
    const hf::SafetensorsCheckpoint weights(dir);
    (void)hf::check_checkpoint(choice.config, weights);
  } catch (const Error& error) {
    throw InputError("model directory '" + dir.string() + "': " + error.what());
  }
  choice.description =
      dir.string() + " (" + choice.config.architecture +
      (choice.quantization ? ", quantized " + choice.quantization->quant_algo : "") + ")";
  choice.tokenizer = tokenizer_of(dir, false);
  return choice;
}

std::shared_ptr<const hf::Tokenizer> tokenizer_of(const std::filesystem::path& dir, bool required) {
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) {
    throw InputError("model directory '" + dir.string() + "' does not exist");
  }
  if (!std::filesystem::is_directory(dir, ec)) {
    throw InputError("model directory '" + dir.string() + "' is not a directory");
  }
  if (!hf::Tokenizer::exists_in(dir)) {
    if (required) throw InputError("model directory '" + dir.string() + "' has no tokenizer.json");
    return nullptr;
  }
  try {
    return std::make_shared<const hf::Tokenizer>(hf::Tokenizer::from_directory(dir));
  } catch (const Error& error) {
    throw InputError("model directory '" + dir.string() + "': " + error.what());
  }
}

std::string tokenizer_line(const ModelChoice& model) {
  return model.tokenizer ? "tokenizer: " + model.tokenizer->description()
                         : std::string("tokenizer: none, text read as bytes");
}

std::vector<std::filesystem::path> tokenizer_files(const ModelChoice& model) {
  std::vector<std::filesystem::path> files;
  if (!model.dir || !model.tokenizer) return files;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(*model.dir / name, ec)) files.push_back(*model.dir / name);
  }
  return files;
}

void check_not_quantized(const ModelChoice& model, const char* command) {
  if (!model.quantization) return;
  throw InputError("model directory '" + model.dir->string() +
                   "' is already quantized (quant_algo " + model.quantization->quant_algo + " in " +
                   model.quantization->source + "); " + command +
                   " needs an unquantized checkpoint");
}

ModelChoice default_model() {
  ModelChoice choice;
  choice.config = hf::LlamaConfig::from_json(std::string(embedded_config_json()));
  choice.description = "the embedded default (data/default/config.json, seeded initialisation)";
  return choice;
}

ModelChoice model_for_inference(const std::optional<std::filesystem::path>& dir,
                                const std::filesystem::path& default_run) {
  if (dir) return model_from_dir(*dir);
  if (const auto latest = train::resume_point(default_run).checkpoint) {
    auto choice = model_from_dir(*latest);
    choice.description = latest->string() + " (latest checkpoint of the default training run)";
    return choice;
  }
  auto choice = default_model();
  choice.description += "; no checkpoint in " + default_run.string() +
                        " yet: run `mdist train` to get a trained model";
  return choice;
}

}  // namespace mdist::cli
