#pragma once
// Private: the INT4 AWQ part of export_hf_checkpoint (modelopt 0.47's W4A16_AWQ), on rank 0's
// whole tensors in the checkpoint layout.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace mdist::quant::detail {

// modelopt's TensorQuantizer.export_amax then `amax.float() / maxbound`: a zero or NaN amax
// becomes maxbound, then clamped to [tiny, max] of the amax's dtype (export.cpp).
at::Tensor scaling_factor(const at::Tensor& amax, double maxbound);

// One AWQ Linear as quantize() left it.
struct AwqLayer {
  std::string name;            // "model.layers.0.mlp.up_proj"
  at::Tensor smoothing;        // fp32 [in], the fold W * smoothing; undefined: none (fallback)
  at::Tensor pre_quant_scale;  // [in], in the weights' dtype
  // W4A8_AWQ: the input quantizer's per-tensor amax (of the smoothed input); W4A16:
  // undefined.
  at::Tensor input_amax;
  // The weight quantizer's block amax as calibrated (out * in / block elements; frozen through
  // quantization-aware training, where the trained weight no longer has it as its block max):
  // modelopt's weight_scale comes from it, unless the layer is re-folded below. Undefined: the
  // block max of the folded weight (what max calibration of that weight gives).
  at::Tensor weight_amax;
};

// modelopt's requantize_resmooth_fused_llm_layers, fuse_prequant_layernorm and
// _export_quantized_weight for W4A16_AWQ, in `tensors` (the whole parameters, checkpoint
// names), `layers` in module order:
//  - each folded weight (W * smoothing) in the weights' dtype;
//  - q/k/v and gate/up (which read one normed input): their pre_quant_scales' mean (in the
//    weights' dtype); a layer whose scale differs is re-folded in fp32, W * old / mean, cast
//    back; the mean is multiplied into the preceding RMSNorm's weight (input_layernorm,
//    post_attention_layernorm; in its dtype) and their pre_quant_scales are not written;
//  - per Linear: weight_scale f32 [out, in / block] = block amax (sanitised) / 7 (the
//    calibrated `weight_amax`; a re-folded layer's recalibrated: the block max of its new
//    weight, as _update_pre_quant_scale redoes the weight's max calibration), weight uint8
//    [out / 2, in] = two int4 codes clamp(round_half_even(W / scale), -8, 7) of rows 2r (low
//    nibble) and 2r + 1 (high nibble); o_proj and down_proj keep `pre_quant_scale`.
// `w4a8` (W4A8_AWQ, the same weights and weight_scale) adds per Linear weight_scale_2 f32 [] =
// the second (FP8) weight stage's amax / 448, that amax max |W| of the weight as written
// (re-folded or not, in its dtype), and input_scale f32 [] = the input amax / 448; q/k/v and
// gate/up share the group's max of each (preprocess_linear_fusion).
// Throws Error for an odd out_features or a shared-input group without its norm.
void export_int4_awq(const std::vector<AwqLayer>& layers, int64_t block_size, bool w4a8,
                     std::map<std::string, at::Tensor>& tensors);

}  // namespace mdist::quant::detail
