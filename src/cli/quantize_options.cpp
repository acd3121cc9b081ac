// See src/cli/quantize_options.h.
#include "src/cli/quantize_options.h"

#include <CLI/CLI.hpp>

namespace mdist::cli {

void declare_quantize_flags(CLI::App& app, QuantizeOptions& o) {
  declare_model_data_flags(app, o.io);
  // Not CLI11's ->required(): a missing --format or --out is reported by the command itself,
  // as its other bad input (one line naming what is expected).
  app.add_option("--format", o.format,
                 "Quantization format, as modelopt's presets: fp8 (FP8_DEFAULT_CFG, quant_algo "
                 "FP8), int8 (INT8_DEFAULT_CFG, W8A8_SQ_PER_CHANNEL), int8_sq "
                 "(INT8_SMOOTHQUANT_CFG: SmoothQuant, alpha 1.0, W8A8_SQ_PER_CHANNEL), "
                 "int4_awq (INT4_AWQ_CFG: AWQ-lite, INT4 weights in blocks of 128, W4A16_AWQ), "
                 "w4a8_awq (W4A8_AWQ_BETA_CFG: AWQ-lite, INT4 weights in blocks of 128 then FP8 "
                 "per tensor, FP8 inputs, W4A8_AWQ) or nvfp4 (NVFP4_DEFAULT_CFG, NVFP4)")
      ->type_name("NAME");
  app.add_option("--sq-alpha", o.sq_alpha,
                 "--format int8_sq: SmoothQuant's migration strength alpha in [0, 1] (modelopt's "
                 "SmoothQuantCalibConfig.alpha; default 1.0, as INT8_SMOOTHQUANT_CFG)")
      ->type_name("A");
  app.add_option("--kv-cache", o.kv_cache,
                 "KV-cache quantization: fp8 (modelopt's FP8_KV_CFG: keys and values E4M3 per "
                 "tensor, max-calibrated; exported as k_scale / v_scale, kv_cache_quant_algo FP8)")
      ->type_name("FORMAT");
  app.add_option("--calib-sequences", o.calib_sequences,
                 "Calibration sequences of --seq-len tokens from --data, split across the "
                 "data-parallel ranks (0: all)")
      ->capture_default_str();
  app.add_option("--eval-data", o.eval_data,
                 "Held-out data for the loss before and after quantization (default: what "
                 "`mdist eval` reads: the embedded corpus's eval split, or all of --data)")
      ->type_name("FILE");
  app.add_option("--eval-sequences", o.eval_sequences, "Held-out sequences (0: all)")
      ->capture_default_str();
  app.add_option("--batch-size", o.batch_size, "Held-out sequences per forward on each rank")
      ->capture_default_str();
  app.add_option("--out", o.out,
                 "Directory of the export (unified Hugging Face checkpoint) and quantize.json")
      ->type_name("DIR");
  app.add_option("--from-run", o.from_run,
                 "Export a quantization-aware training run (mdist train --quant) instead of "
                 "calibrating: its latest checkpoint (or the checkpoint given) with the quantizers "
                 "it trained with; the format is the run's")
      ->type_name("RUN");
  app.callback([&app, &o] {
    for (const CLI::Option* option : app.get_options()) {
      if (option->count() > 0) o.given.insert(option->get_name());
    }
  });
  app.footer(
      "\nWithout --model: the latest checkpoint of runs/default, else the seeded default model.");
}

}  // namespace mdist::cli
