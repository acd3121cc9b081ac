#pragma once
// Fake quantization with exactly modelopt 0.47's arithmetic (quantize, then dequantize back to
// the input's dtype), in libtorch ops only: CPU and CUDA alike, no custom kernels.
//
//   y = mdist::quant::fake_quant(w, amax, QuantFormat::int8_per_row());   // no autograd
//   y = mdist::quant::fake_quant_ste(x, amax, QuantFormat::fp8());        // with the STE
//
// The arithmetic, in fp32 whatever the input dtype, the result cast back to it:
// - integers: modelopt's `_tensor_quant` (`tensor_quant.py`): s = maxbound / amax;
//   q = clamp(round_half_even(x * s), min, max); y = q / s. Where amax <= 2^-24, the
//   output is 0.
// - E4M3: `_fp8_eager`: amax <= 2^-24 counts as 1; s = 448 / amax (as torch evaluates it:
//   reciprocal(amax) * 448); y = e4m3(clamp(x * s, +-448)) * reciprocal(s).
// - NVFP4: the Triton kernel `fp4_fake_quant_kernel` (`fp4_kernel_hopper.py`): per 16
//   consecutive elements of the last dim, gs = global_amax / 2688 (1e-12 when 0),
//   s = e4m3(min(blockmax / (6 gs), 448)) * gs, s < 1e-5 -> 1, y = sign(x) E2M1(|x| / s) s,
//   E2M1 rounding to {0, .5, 1, 1.5, 2, 3, 4, 6} with ties to the even code.
// On CUDA, modelopt itself calls compiled kernels (its `fake_e4m3fy` / `fake_tensor_quant`
// extensions, Triton for NVFP4); these functions compute the same formulas with ATen ops, which
// is what modelopt runs on CPU (and wherever its extensions are missing). For NVFP4, Triton's
// fp32 division is not correctly rounded (PTX div.full.f32) while ATen's is: on an exact E2M1
// threshold the GPU kernel can land one code away; this gives the exactly rounded result.
//
// amax: per tensor, one element (any shape); per row, x.size(0) elements; static blocks, one
// per block (rows of the last dim padded to whole blocks, in row-major order: modelopt's
// `[blocks, 1]`). An amax of more than one element is viewed in the shape modelopt broadcasts
// it in (`[rows, 1, ...]`, `[blocks, 1]`); a 0-d amax stays 0-d, as modelopt keeps it, because
// that decides the dtype of the backward's comparison (a 0-d fp32 amax against bf16 inputs is
// compared in bf16). NVFP4 takes the per-tensor global amax.
#include <ATen/core/Tensor.h>
#include <torch/autograd.h>

#include "mdist/quant/format.h"

namespace mdist::quant {

// The gradient of fake quant (modelopt's `pass_through_bwd`): `pass_through` hands the output
// gradient on unchanged, which is modelopt 0.47's default; `clipped` zeroes it where
// |x| > amax (NVFP4: the global amax), the straight-through estimator with clipping. amax never
// gets a gradient (it is a buffer).
enum class Backward { pass_through, clipped };

// The fake-quantized x, outside autograd (no graph is recorded, even for an x that requires
// grad). Errors (mdist::Error): an amax whose size does not fit the format, a negative amax,
// negative inputs to an unsigned format, a 0-d x.
at::Tensor fake_quant(const at::Tensor& x, const at::Tensor& amax, const QuantFormat& format);
// NVFP4 (QuantFormat::nvfp4()) under a per-tensor global amax.
at::Tensor nvfp4_fake_quant(const at::Tensor& x, const at::Tensor& global_amax);

// The same forward as fake_quant, differentiable in x through FakeQuantFunction.
at::Tensor fake_quant_ste(const at::Tensor& x, const at::Tensor& amax, const QuantFormat& format,
                          Backward backward);

// The autograd node: forward fake-quantizes x (already in blocks for static blocks, amax in its
// broadcast shape: fake_quant_ste prepares both, as modelopt's TensorQuantizer does before
// calling its autograd functions), backward is the STE. Saves (x, amax) only when clipped.
struct FakeQuantFunction : torch::autograd::Function<FakeQuantFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& amax, const QuantFormat& format, Backward backward);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

}  // namespace mdist::quant
