// See src/cli/calibrate_options.h.
#include "src/cli/calibrate_options.h"

#include <CLI/CLI.hpp>

namespace mdist::cli {

void declare_calibrate_flags(CLI::App& app, CalibrateOptions& o) {
  declare_model_data_flags(app, o.io);
  app.add_option("--max-sequences", o.max_sequences, "Sequences to run over all ranks (0: all)")
      ->capture_default_str();
  app.add_option("--out", o.out, "JSON output file")->capture_default_str()->type_name("FILE");
  app.add_flag("--allow-incomplete-moe", o.allow_incomplete_moe,
               "Write the result although some routed experts received no "
               "calibration tokens on some or all of their ranks (they are "
               "reported; an expert no rank saw gets input_absmax null)");
  app.footer(
      "\nWithout --model: the latest checkpoint of runs/default, else the seeded default model.");
}

}  // namespace mdist::cli
