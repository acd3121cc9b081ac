// NVFP4 export arithmetic: see src/quant/nvfp4_export.h.
#include "src/quant/nvfp4_export.h"

#include <ATen/ATen.h>

#include <string>

#include "mdist/error.h"

namespace mdist::quant::detail {
namespace {

constexpr int64_t kBlock = 16;
// E2M1_MAX * E4M3_MAX: modelopt's divisor of the global amax.
constexpr double kGlobalScaleDivisor = 6.0 * 448.0;

// modelopt's `NVFP4QTensor._cast_fp4`: |x| to its E2M1 code by searchsorted on the rounding
// bounds (a value on a bound takes the lower code), plus one on the bounds .75, 1.75 and 3.5
// (there the upper code is the even one), and the sign bit where x < 0 (so -0.1 is -0).
at::Tensor cast_fp4(const at::Tensor& scaled) {
  const auto opts = scaled.options();
  const at::Tensor bounds =
      at::tensor({0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f}, opts.dtype(at::kFloat));
  const at::Tensor odd_bounds = at::tensor({0.75f, 1.75f, 3.5f}, opts.dtype(at::kFloat));
  const at::Tensor sign = (scaled < 0).to(at::kByte);
  const at::Tensor magnitude = scaled.abs();
  const at::Tensor code = at::searchsorted(bounds, magnitude, /*out_int32=*/true).to(at::kByte);
  const at::Tensor on_odd_bound = (magnitude.unsqueeze(-1) == odd_bounds).any(-1).to(at::kByte);
  return at::bitwise_left_shift(sign, 3) + code + on_odd_bound;
}

}  // namespace

Nvfp4Weight nvfp4_export_weight(const at::Tensor& weight, const at::Tensor& weight_amax) {
  if (weight.dim() != 2 || weight.size(1) % kBlock != 0) {
    throw Error(
        "mdist::quant: NVFP4 export needs a 2-d weight whose columns are a multiple of 16, "
        "not " +
        c10::str(weight.sizes()));
  }
  const int64_t rows = weight.size(0), blocks = weight.size(1) / kBlock;
  Nvfp4Weight out;
  // get_weights_scaling_factor_2_from_quantizer: _amax.float() / (6 * 448).
  out.weight_scale_2 =
      (weight_amax.to(at::kFloat).to(weight.device()) / kGlobalScaleDivisor).reshape({});
  // get_weights_scaling_factor: block max |W| in the weight's dtype, then fp32, divided by
  // (6 * weight_scale_2); a zero block's scale is 1; clamped to E4M3's [2^-9, 448] and cast.
  const at::Tensor blocked = weight.reshape({rows, blocks, kBlock});
  const at::Tensor block_amax =
      at::maximum(at::amax(blocked, {-1}).abs(), at::amin(blocked, {-1}).abs()).to(at::kFloat);
  at::Tensor block_scale = block_amax / (out.weight_scale_2 * 6.0);
  block_scale = at::where(block_scale == 0, at::ones_like(block_scale), block_scale);
  out.weight_scale = block_scale.clamp(1.0 / 512.0, 448.0).to(at::kFloat8_e4m3fn);
  // NVFP4QTensor.quantize: W / (scale * scale_2) per block (fp32), E2M1 codes, packed.
  const at::Tensor divisor = (out.weight_scale.to(at::kFloat) * out.weight_scale_2).unsqueeze(-1);
  const at::Tensor codes = cast_fp4(blocked / divisor).view({rows, blocks * kBlock});
  using at::indexing::Slice;
  const at::Tensor low = codes.index({Slice(), Slice(0, at::indexing::None, 2)});
  const at::Tensor high = codes.index({Slice(), Slice(1, at::indexing::None, 2)});
  out.packed = at::bitwise_or(at::bitwise_left_shift(high, 4), low).contiguous();
  return out;
}

at::Tensor nvfp4_input_scale(const at::Tensor& input_amax) {
  // TensorQuantizer.export_amax for a dynamic block quantizer: 0 or NaN -> maxbound (6), no
  // clamp; then get_activation_scaling_factor's amax.float() / (6 * 448).
  const at::Tensor sanitized =
      at::nan_to_num(at::where(input_amax == 0, at::full_like(input_amax, 6.0), input_amax), 6.0);
  return (sanitized.to(at::kFloat) / kGlobalScaleDivisor).reshape({});
}

}  // namespace mdist::quant::detail
