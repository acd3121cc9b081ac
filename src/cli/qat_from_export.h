#pragma once
// Quantization-aware training continued from a quantized export: `mdist train --quant F
// --model EXPORT`, where EXPORT is a unified HF checkpoint (mdist quantize's, train
// --export-quantized's or modelopt's) in F's format. The loader reads its weights dequantized
// (code x weight_scale, exactly on the quantization grid); the quantizers of F's preset then take
// the export's scales as their calibrated amax, with no calibration:
//   amax = scale x maxbound   (FP8: 448, INT8: 127; weight per tensor or per output row),
// which inverts the export's scale = amax / maxbound (modelopt's export_amax / maxbound) up to
// fp32 rounding. Inputs are then fake-quantized exactly as `mdist eval` reads the export back
// (quant::apply_checkpoint_quantization sets the same amax); weights, already on the grid, are
// fake-quantized back onto it, so the continued model's first forward is the export's read-back
// (the odd weight one fp32 step apart where scale x 448 / 448 is not the scale again).
#include <filesystem>
#include <memory>
#include <string>

#include "mdist/hf/parallelize.h"
#include "mdist/quant/quantize.h"
#include "src/cli/model_choice.h"
#include "src/cli/train_options.h"

namespace mdist::cli {

// InputError unless a quantized `model` can start `options`' QAT: --quant given and matching its
// quant_algo (fp8: FP8, int8: W8A8_SQ_PER_CHANNEL without SmoothQuant's pre_quant_scale), no
// KV-cache quantization, and no --calib-data / --calib-sequences (the export's scales are the
// calibration). Nothing to check for an unquantized model. Call inside agree_on_inputs.
void check_qat_start_model(const TrainOptions& options, const ModelChoice& model);

// The quantizers of `options`' preset on `model` (loaded from the export `dir`, on the job's
// layout), their amax from the export's weight_scale / input_scale (this rank's rows of a
// column-parallel per-row weight amax). Error when a quantizer the preset enables has no scale
// in the export.
std::unique_ptr<quant::ModelQuantizers> start_qat_from_export(const TrainOptions& options,
                                                              hf::CausalLM& model,
                                                              const hf::Parallelism& parallelism,
                                                              const std::filesystem::path& dir);

}  // namespace mdist::cli
