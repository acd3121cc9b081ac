// See src/cli/sft_examples.h.
#include "src/cli/sft_examples.h"

#include <nlohmann/json.hpp>
#include <string_view>

#include "src/cli/documents.h"
#include "src/cli/input_error.h"

namespace mdist::cli {
namespace {

// The string field `field` of a JSON object line, or InputError naming where.
std::string field_of(const nlohmann::json& json, const std::string& field, const char* flag,
                     const std::string& where) {
  if (!json.contains(field) || !json[field].is_string()) {
    throw InputError(where + " has no string field '" + field + "' (" + flag + ")");
  }
  return json[field].get<std::string>();
}

}  // namespace

std::optional<SftExample> sft_example_of_line(std::string_view line, const hf::Tokenizer& tokenizer,
                                              const std::string& prompt_field,
                                              const std::string& completion_field,
                                              const std::string& where) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  if (line.find_first_not_of(" \t") == std::string_view::npos) return std::nullopt;
  const auto json = nlohmann::json::parse(line, nullptr, false);
  if (json.is_discarded() || !json.is_object()) {
    throw InputError(where + " is not a JSON object");
  }
  const std::string prompt = field_of(json, prompt_field, "--prompt-field", where);
  const std::string completion = field_of(json, completion_field, "--completion-field", where);
  if (completion.empty()) {
    throw InputError(where + " has an empty '" + completion_field + "'");
  }
  SftExample example;
  example.prompt_tokens = static_cast<std::int64_t>(tokenizer.encode(prompt, true).size());
  example.ids = tokenizer.encode(prompt + completion, true);
  if (const std::optional<std::int32_t> eos = tokenizer.eos_token_id()) example.ids.push_back(*eos);
  if (example.prompt_tokens >= static_cast<std::int64_t>(example.ids.size())) {
    // The completion merged into the prompt's tokens.
    throw InputError(where + ": the completion adds no token after the prompt's");
  }
  return example;
}

std::vector<SftExample> read_sft_examples(const std::filesystem::path& path,
                                          const hf::Tokenizer& tokenizer,
                                          const ModelDataOptions& options, std::int64_t seq_len,
                                          std::int64_t vocab_size) {
  const MappedFile file(path, "data file");
  const std::string_view text(reinterpret_cast<const char*>(file.data()), file.size());
  std::vector<SftExample> examples;
  std::int64_t number = 0;
  for (std::size_t at = 0; at < text.size();) {
    std::size_t stop = text.find('\n', at);
    if (stop == std::string_view::npos) stop = text.size();
    const std::string_view line = text.substr(at, stop - at);
    at = stop + 1;
    ++number;
    const std::string where = "data file '" + path.string() + "' line " + std::to_string(number);
    std::optional<SftExample> example =
        sft_example_of_line(line, tokenizer, options.prompt_field, options.completion_field, where);
    if (!example) continue;
    const auto length = static_cast<std::int64_t>(example->ids.size());
    if (length > seq_len) {
      throw InputError(where + ": its example has " + std::to_string(length) +
                       " tokens, more than --seq-len " + std::to_string(seq_len));
    }
    for (const std::int32_t id : example->ids) {
      if (id < 0 || id >= vocab_size) {
        throw InputError(where + ": token " + std::to_string(id) +
                         " is outside the model's vocabulary [0, " + std::to_string(vocab_size) +
                         ")");
      }
    }
    examples.push_back(std::move(*example));
  }
  if (examples.empty()) throw InputError("data file '" + path.string() + "' holds no example");
  return examples;
}

}  // namespace mdist::cli
