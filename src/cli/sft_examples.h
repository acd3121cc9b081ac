#pragma once
// The examples of a supervised fine-tuning file (--format sft): JSON Lines, one object per line
// with a prompt and a completion string, tokenized as TRL's SFTTrainer tokenizes
// prompt-completion data (the rule: src/cli/sft_data.h). Blank lines are skipped.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mdist/hf/tokenizer.h"
#include "src/cli/flags.h"

namespace mdist::cli {

struct SftExample {
  std::vector<std::int32_t> ids;   // encode(prompt + completion, special tokens) + EOS
  std::int64_t prompt_tokens = 0;  // len(encode(prompt, special tokens)): ids carrying no loss
};

// The example of one line of such a file (without its '\n'; a trailing '\r' is dropped), or
// nothing for a blank line. InputError, its message starting with `where` ("data file 'F' line
// N"), for a line that is not a JSON object, lacks a string field, has an empty completion or
// whose completion adds no token after the prompt's. Shared by read_sft_examples and
// `mdist tokenize --format sft`, so that both tokenize a line alike.
std::optional<SftExample> sft_example_of_line(std::string_view line, const hf::Tokenizer& tokenizer,
                                              const std::string& prompt_field,
                                              const std::string& completion_field,
                                              const std::string& where);

// The examples of `path` in file order, with options.prompt_field / completion_field.
// InputError naming the file and its line for a line that is not a JSON object, lacks a
// string field, has an empty completion, whose example has more than seq_len tokens, or whose
// ids fall outside [0, vocab_size); for a file without examples.
std::vector<SftExample> read_sft_examples(const std::filesystem::path& path,
                                          const hf::Tokenizer& tokenizer,
                                          const ModelDataOptions& options, std::int64_t seq_len,
                                          std::int64_t vocab_size);

}  // namespace mdist::cli
