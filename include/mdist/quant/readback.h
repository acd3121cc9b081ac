#pragma once
// Reading a quantized checkpoint back as the quantized model it describes (issue 28, item 6):
// modelopt's unified HF export (FP8, W8A8_SQ_PER_CHANNEL, NVFP4, W4A16_AWQ), modelopt's own or
// quant::export_hf_checkpoint's.
//
//   hf::ParallelModel built = hf::load_pretrained_fsdp2(dir, options);  // weights dequantized
//   auto quantizers = mdist::quant::apply_checkpoint_quantization(built.model, dir);
//   model->forward(ids);   // inputs fake-quantized with the checkpoint's input_scale
//
// The loaders (mdist/hf/quantized_checkpoint.h) already read every quantized weight
// dequantized (weight x weight_scale): those values are exactly on the quantization grid, so
// the weight quantizers stay disabled. What remains is the activations: every Linear with an
// `input_scale` gets its input quantizer in the checkpoint's format (E4M3 for FP8, INT8 per
// tensor for W8A8_SQ_PER_CHANNEL, NVFP4's dynamic blocks of 16 for NVFP4) with amax =
// input_scale x maxbound (NVFP4: x 6 x 448, its global amax), frozen (no calibration;
// quantize mode), through the same ModelQuantizers hooks quant::quantize installs. A Linear
// without one (the exclude_modules: lm_head, routers) stays unquantized. A SmoothQuant export
// (INT8_SMOOTHQUANT_CFG: its weights are smoothed, W / s) also holds `pre_quant_scale` (s) per
// Linear: the input quantizer multiplies its input by it first, as modelopt's does. An INT4 AWQ
// export (W4A16_AWQ: weight-only) has no input_scale; its o_proj and down_proj hold the AWQ
// pre_quant_scale, applied the same way by their (disabled) input quantizers. Under
// tensor parallelism a row-parallel Linear (o_proj, down_proj) holds part of the input
// channels: its pre_quant_scale is cut to this rank's columns (the weight's placement in
// `parallelism`). W4A8_AWQ: W4A16_AWQ's pre_quant_scales and FP8 input scales.
//
// The fake-quant loss of the model quant::quantize returned and that of its export read back
// differ by the export's rounding: the export divides W by the scale where fake quant
// multiplies by its reciprocal (a few codes one step apart), and amax / maxbound x maxbound is
// not always amax again in fp32. NVFP4 adds modelopt's fused-layer rule: q/k/v and gate/up
// are exported under the group's largest weight amax (one weight_scale_2), so their block
// scales, and then their codes, can differ from the fake quant's, which uses each layer's own.
#include <filesystem>
#include <memory>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/parallelize.h"
#include "mdist/quant/quantize.h"

namespace mdist::quant {

// The input quantizers of the checkpoint in `dir` on `model` (loaded from it, plain, wrapped or
// split alike: the input amax is one value per tensor), or null for a checkpoint without
// quantization. A kv_cache_quant_algo FP8 also puts k/v quantizers (E4M3, amax = k_scale /
// v_scale x 448, frozen) on every attention: keys and values fake-quantized in every forward,
// generate's cache included. `parallelism`: how `model` is split (hf::apply_parallelism's
// result; empty for an unsplit model). Throws Error for a quant_algo other than FP8,
// W8A8_SQ_PER_CHANNEL, NVFP4, W4A16_AWQ and W4A8_AWQ, for another KV-cache algorithm, for a
// missing k/v scale, for a scale that is not one value and for a pre_quant_scale that is not
// one value per input channel of the whole Linear. Not collective.
std::unique_ptr<ModelQuantizers> apply_checkpoint_quantization(
    hf::CausalLM& model, const std::filesystem::path& dir,
    const hf::Parallelism& parallelism = hf::Parallelism());

}  // namespace mdist::quant
