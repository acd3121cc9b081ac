#pragma once
// Quantization-aware training's start (`mdist train --quant F`): modelopt's QAT recipe
// (`mtq.quantize` with a preset, then ordinary training of the fake-quantized model) on the
// library's mdist::quant. The quantizers are inserted and max-calibrated once, before step 1,
// exactly as `mdist quantize` calibrates (one sequence per forward, sequences split across the
// data-parallel ranks, amax synced over data and tensor parallel); their amax then stays frozen
// and every training forward fake-quantizes inputs and weights, the gradient passing through
// fake quant as --quant-backward says. The model's parameters stay the fp32 master weights.
// The amax goes into the run directory and every checkpoint (kQatStateFile); a resumed run
// takes it from there instead of calibrating again, so it continues the same training.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "mdist/hf/parallelize.h"
#include "mdist/quant/quantize.h"
#include "src/cli/job_layout.h"
#include "src/cli/token_data.h"
#include "src/cli/train_options.h"

namespace mdist::cli {

// The calibration the run asked for: the first `sequences` windows of `windows` (file order).
struct QatCalibration {
  const Windows& windows;
  std::string description;  // the calibration data's description
  std::int64_t sequences = 0;
};

// --calib-sequences applied to the calibration windows (0: all of them).
std::int64_t calibration_sequences(const TrainOptions& options, const Windows& windows);

// modelopt's preset for --quant with --quant-backward's pass_through_bwd.
quant::QuantConfig qat_config(const TrainOptions& options);

// Inserts the quantizers into `model` (already built for the job's layout) and calibrates them
// on `calibration`. Collective over every rank of the job. The hooks live as long as the result;
// it must outlive every forward of the model.
std::unique_ptr<quant::ModelQuantizers> start_quantization_aware_training(
    const TrainOptions& options, hf::CausalLM& model, const hf::Parallelism& parallelism,
    const JobLayout& layout, const QatCalibration& calibration);

// Where the quantizers' state lives: the run directory holds it from the start (its amax is
// frozen), every checkpoint carries a copy. safetensors: "<quantizer name>._amax" as
// quant::whole_amax_state_dict gives them (whole over tensor parallelism), metadata "quant" =
// describe_qat.
inline constexpr const char* kQatStateFile = "qat_quantizers.safetensors";

// Writes the quantizers' state into `path` (rank 0). Collective over the tensor-parallel group.
void save_qat_state(const quant::ModelQuantizers& quantizers, const hf::Parallelism& parallelism,
                    const TrainOptions& options, const std::filesystem::path& path);

// A resumed QAT run: the quantizers of `options` inserted into `model` with the amax of
// `checkpoint`'s kQatStateFile (this rank's rows of a column-parallel per-row weight amax), no
// calibration. Error when the file lacks a weight quantizer's amax.
std::unique_ptr<quant::ModelQuantizers> resume_quantization_aware_training(
    const TrainOptions& options, hf::CausalLM& model, const hf::Parallelism& parallelism,
    const std::filesystem::path& checkpoint);

// The run's metadata entry (run_flags' "quant"): the format, the backward, the calibration.
// "none" for a run without --quant.
std::string describe_qat(const TrainOptions& options);

}  // namespace mdist::cli
