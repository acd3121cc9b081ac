#pragma once
// One-pass CPU kernels for the elementwise part of fake quant (src/quant/fake_quant.cpp), for
// contiguous fp32 inputs on the CPU. Each computes, element by element, exactly the fp32
// operations that fake_quant.cpp's ATen op sequence performs (the same products, quotients,
// clamps, round-half-even and E4M3 conversions, in the same order, NaN and infinities
// included), so its results are bit-identical to that sequence's; it reads x once and writes
// y once instead of allocating a full-size temporary per op. The per-tensor and per-row
// factors (scales, reciprocals, the tiny-amax rule) are still computed by ATen ops in
// fake_quant.cpp and passed in: only the per-element loop is replaced.
// tests/quant/fake_quant_kernel_test.cpp compares both paths bit for bit. CUDA, other dtypes
// and layouts keep the ATen path.
#include <ATen/core/Tensor.h>

#include "mdist/quant/format.h"

namespace mdist::quant::detail {

// mdist::quant::fake_quant with the ATen op sequence only (never these kernels): the
// reference the kernels are tested against.
at::Tensor fake_quant_aten(const at::Tensor& x, const at::Tensor& amax, const QuantFormat& format);

// Whether the kernels take x (on the CPU, fp32, contiguous, at least one element) quantized
// against `factors` (a tensor of one element, or of x.size(0) elements laid out along dim 0
// only, as fake_quant.cpp broadcasts a per-row or per-block amax) without changing the
// result's shape.
bool cpu_kernel_applies(const at::Tensor& x, const at::Tensor& factors);

// E4M3: y = float(e4m3(clamp(x * scale, -448, 448))) * scale_inv, with scale and scale_inv
// fp32, one element or one per row of x.
at::Tensor e4m3_fake_quant_cpu(const at::Tensor& x, const at::Tensor& scale,
                               const at::Tensor& scale_inv);

// Integers: y = clamp(round_half_even(x * scale), min_bound, max_bound) / divisor, with scale
// and divisor fp32, one element or one per row of x.
at::Tensor integer_fake_quant_cpu(const at::Tensor& x, const at::Tensor& scale,
                                  const at::Tensor& divisor, double min_bound, double max_bound);

// NVFP4 over blocks of 16 along the last dim (a row's tail read as zeros): s =
// float(e4m3(min(blockmax |x| / divisor, 448))) * global_scale, s < 1e-5 (as fp32) -> 1,
// y = (x >= 0 ? 1 : -1) E2M1(|x| / s) s. global_scale and divisor (global_scale * 6) are the
// fp32 values fake_quant.cpp computes.
at::Tensor nvfp4_fake_quant_cpu(const at::Tensor& x, float global_scale, float divisor);

}  // namespace mdist::quant::detail
