// See src/cli/tokenize_options.h.
#include "src/cli/tokenize_options.h"

#include <CLI/CLI.hpp>

namespace mdist::cli {

void declare_tokenize_flags(CLI::App& app, TokenizeOptions& o) {
  app.add_option("--model", o.model_dir, "Model directory with tokenizer.json")
      ->required()
      ->type_name("DIR");
  app.add_option("--data", o.data, "Corpus: text or JSON Lines")->required()->type_name("FILE");
  app.add_option("--out", o.out,
                 "Token file: .u32 (little-endian uint32) or .u16 (when the vocabulary fits); "
                 "written atomically, the same bytes on any number of ranks")
      ->required()
      ->type_name("FILE");
  app.add_option("--format", o.format,
                 "text, jsonl, or sft (prompt / completion JSON Lines: the ids plus a loss-mask "
                 "file OUT.mask, for train / eval --data OUT --format sft)")
      ->capture_default_str();
  app.add_option("--field", o.field, "jsonl: the field holding the text")->capture_default_str();
  app.add_option("--prompt-field", o.prompt_field, "sft: the prompt's JSON field")
      ->capture_default_str();
  app.add_option("--completion-field", o.completion_field, "sft: the completion's JSON field")
      ->capture_default_str();
  app.add_option("--sample-by", o.sample_by,
                 "text: a document is a line, a paragraph (lines up to an empty line) or the "
                 "whole file")
      ->capture_default_str();
  declare_timeout_flag(app, o.timeout_s);
  app.footer(
      "\nEach document is encoded with its special tokens, then EOS. --format sft encodes each "
      "line's prompt + completion as train --format sft does and writes OUT.mask beside OUT: one "
      "byte a token, 1 where the loss is taken, +2 where an example starts. Under mdistrun the "
      "ranks split the corpus at document boundaries.");
}

}  // namespace mdist::cli
