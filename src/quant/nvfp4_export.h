#pragma once
// NVFP4's export arithmetic, as modelopt 0.47's export_hf_checkpoint does it for a dynamic
// NVFP4 Linear (`_export_quantized_weight`, `NVFP4QTensor.get_weights_scaling_factor` and
// `.quantize`, `get_activation_scaling_factor`), so that the bytes are modelopt's:
//   weight_scale_2 f32 []           = weight_amax.float() / 2688            (2688 = 6 * 448)
//   weight_scale   e4m3 [out, in/16] = e4m3(clamp(bmax / (6 weight_scale_2), 2^-9, 448)),
//                                     bmax the block's max |W| in fp32, a 0 first made 1
//   weight         uint8 [out, in/2]: W / (weight_scale.float() * weight_scale_2) in fp32 (a bf16
//                                     weight promotes), to E2M1 codes (searchsorted on the
//                                     bounds .25 .75 1.25 1.75 2.5 3.5 5, ties on .75 1.75 3.5
//                                     one code up: ties to even), sign bit 8 where W < 0, two
//                                     codes per byte, the even column in the low nibble
//   input_scale    f32 []           = sanitized(input_amax).float() / 2688  (0 or NaN -> 6)
// These are not the fake quant's operations (that divides by its block scale computed from the
// layer's own amax, and modelopt's export first gives fused q/k/v and gate/up the group's
// largest amax); the difference is the export's rounding.
#include <ATen/core/Tensor.h>

namespace mdist::quant::detail {

struct Nvfp4Weight {
  at::Tensor packed;          // uint8 [out, in / 2]
  at::Tensor weight_scale;    // float8_e4m3fn [out, in / 16]
  at::Tensor weight_scale_2;  // float32 []
};

// `weight` [out, in] (fp32 or bf16, in a multiple of 16), `weight_amax` its per-tensor amax.
Nvfp4Weight nvfp4_export_weight(const at::Tensor& weight, const at::Tensor& weight_amax);

// The 0-d input_scale of an input quantizer's per-tensor amax.
at::Tensor nvfp4_input_scale(const at::Tensor& input_amax);

}  // namespace mdist::quant::detail
