// See src/cli/eval_options.h.
#include "src/cli/eval_options.h"

#include <CLI/CLI.hpp>

namespace mdist::cli {

void declare_eval_flags(CLI::App& app, EvalOptions& o) {
  declare_model_data_flags(app, o.io);
  declare_sft_flags(app, o.io);
  app.add_option("--batch-size", o.batch_size, "Sequences per forward on each rank")
      ->capture_default_str();
  app.add_option("--out", o.out, "Also write the result as JSON to FILE")->type_name("FILE");
  app.footer(
      "\nWithout --model: the latest checkpoint of runs/default, else the seeded default model.");
}

}  // namespace mdist::cli
