#pragma once
// `mdist quantize --from-run RUN --out DIR`: the unified HF checkpoint of a quantization-aware
// training run (mdist train --quant F), from the weights of RUN's latest checkpoint (or of the
// checkpoint RUN names) and the quantizers it trained with (its kQatStateFile: the amax as
// calibrated before step 1), without calibrating. The format is the run's. Flags that only
// calibration or the held-out loss would read (--model, --data, --calib-sequences, --sq-alpha,
// --kv-cache, --eval-data, ...) are refused rather than ignored, as is a --format other than the
// run's and a run that was not trained with --quant (one line, exit 2, nothing written).
// Writes the export and a quantize.json naming the run; the same bytes as `mdist train
// --export-quantized` of that run.
#include "src/cli/quantize_options.h"

namespace mdist::cli {

int run_quantize_from_run(const QuantizeOptions& options);

}  // namespace mdist::cli
