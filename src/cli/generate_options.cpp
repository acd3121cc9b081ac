// See src/cli/generate_options.h.
#include "src/cli/generate_options.h"

#include <CLI/CLI.hpp>

namespace mdist::cli {

void declare_generate_flags(CLI::App& app, GenerateOptions& o) {
  app.add_option("--model", o.model_dir, "Hugging Face model directory")->type_name("DIR");
  app.add_option("--prompt", o.prompts,
                 "Text to continue (repeatable: a batch; default \"MACBETH.\\n\")")
      ->type_name("TEXT");
  app.add_option("--prompts", o.prompts_file, "Prompts, one a line (blank lines skipped)")
      ->type_name("FILE");
  app.add_option("--max-new-tokens", o.max_new_tokens, "Tokens (bytes) to generate per prompt")
      ->capture_default_str();
  app.add_option("--temperature", o.temperature, "Softmax temperature")->capture_default_str();
  app.add_option("--top-k", o.top_k, "Sample among the k likeliest (0: all)")
      ->capture_default_str();
  app.add_option("--top-p", o.top_p, "Sample among the likeliest whose probability reaches p")
      ->capture_default_str();
  app.add_flag("--greedy", o.greedy, "Always take the likeliest token");
  app.add_option("--seed", o.seed, "Sampling seed")->capture_default_str();
  declare_tensor_parallel_flag(app, o.tensor_parallel);
  declare_timeout_flag(app, o.timeout_s);
  declare_param_dtype_flag(app, o.param_dtype);
  app.footer(
      "\nWithout --model: the latest checkpoint of runs/default, else the seeded default model."
      "\nGeneration stops at --max-new-tokens or at the model's end-of-sequence token.");
}

}  // namespace mdist::cli
