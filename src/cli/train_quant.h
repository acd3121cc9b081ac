#pragma once
// Quantization-aware training's start (`mdist train --quant F`): modelopt's QAT recipe
// (`mtq.quantize` with a preset, then ordinary training of the fake-quantized model) on the
// library's mdist::quant. The quantizers are inserted and calibrated once, before step 1,
// exactly as `mdist quantize` calibrates (max calibration; AWQ-lite for int4_awq; NVFP4's
// per-tensor global amax with dynamic blocks; with --kv-cache fp8 the k/v quantizers too; one
// sequence per forward, sequences split across the data-parallel ranks, amax synced over data
// and tensor parallel); their amax then stays frozen and every training forward fake-quantizes
// inputs and weights, the gradient passing through fake quant as --quant-backward says. The
// model's parameters stay the fp32 master weights. AWQ's weight scale is folded into those
// parameters once, after calibration, as modelopt folds it into `weight.data`: training then
// moves the folded weights, as modelopt's QAT does. The amax (and AWQ's pre_quant_scale) goes
// into the run directory and every checkpoint (kQatStateFile); a resumed run takes it from
// there instead of calibrating again, so it continues the same training.
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

// modelopt's preset for --quant with --quant-backward's pass_through_bwd, and --kv-cache's
// rules.
quant::QuantConfig qat_config(const TrainOptions& options);

// "max" or "AWQ-lite" (int4_awq): the calibration --quant runs, for the run's log line.
std::string qat_calibration_method(const TrainOptions& options);

// The model's shapes against --quant and --kv-cache (InputError): the block formats' whole
// blocks along every quantized Linear's inputs (per tensor-parallel shard), no FP8 KV cache on
// a fused qkv_proj. Before anything is loaded (the shapes come from `config` alone).
void check_qat_model(const TrainOptions& options, const hf::LlamaConfig& config);

// Inserts the quantizers into `model` (already built for the job's layout) and calibrates them
// on `calibration`. Collective over every rank of the job. The hooks live as long as the result;
// it must outlive every forward of the model.
std::unique_ptr<quant::ModelQuantizers> start_quantization_aware_training(
    const TrainOptions& options, hf::CausalLM& model, const hf::Parallelism& parallelism,
    const JobLayout& layout, const QatCalibration& calibration);

// Where the quantizers' state lives: the run directory holds it from the start (its amax is
// frozen), every checkpoint carries a copy. safetensors: "<quantizer name>._amax" as
// quant::whole_amax_state_dict gives them (whole over tensor parallelism; the KV cache's
// k_bmm / v_bmm quantizers included) and "<linear>.input_quantizer._pre_quant_scale" (AWQ;
// already folded into the saved weights), metadata "quant" = describe_qat.
inline constexpr const char* kQatStateFile = "qat_quantizers.safetensors";

// Writes the quantizers' state into `path` (rank 0). Collective over the tensor-parallel group.
void save_qat_state(const quant::ModelQuantizers& quantizers, const hf::Parallelism& parallelism,
                    const TrainOptions& options, const std::filesystem::path& path);

// A resumed QAT run: the quantizers of `options` inserted into `model` with the amax (and
// pre_quant_scale) of `checkpoint`'s kQatStateFile (this rank's rows of a column-parallel
// per-row weight amax), no calibration, nothing folded again (the checkpoint's weights are the
// folded ones). Error when the file lacks a weight quantizer's amax or an AWQ layer's
// pre_quant_scale.
std::unique_ptr<quant::ModelQuantizers> resume_quantization_aware_training(
    const TrainOptions& options, hf::CausalLM& model, const hf::Parallelism& parallelism,
    const std::filesystem::path& checkpoint);

// The run's metadata entry (run_flags' "quant"): the format, the backward, the KV cache, the
// calibration.
// "none" for a run without --quant.
std::string describe_qat(const TrainOptions& options);

}  // namespace mdist::cli
