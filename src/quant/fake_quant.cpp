// Fake quantization as modelopt 0.47 computes it. Each formula below follows modelopt's op
// sequence operand by operand (a Python `a / t` is `reciprocal(t) * a` in torch, a division by
// a 0-d tensor is not one by a scalar on CUDA, ...): that, not just the same formula, is what
// makes the results equal bit for bit.
#include "mdist/quant/fake_quant.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "mdist/error.h"
#include "src/quant/fake_quant_cpu.h"
#include "src/quant/layout.h"

namespace mdist::quant {
namespace {

// modelopt's threshold for "amax is zero" (the smallest fp16 subnormal).
constexpr double kTinyAmax = 1.0 / (1 << 24);

std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

// `_tensor_quant`: integer fake quant with an amax that broadcasts against x.
// `kernel`: the one-pass CPU kernel may compute the elementwise part (fake_quant_cpu.h).
at::Tensor integer_fake_quant(const at::Tensor& x, const at::Tensor& amax,
                              const QuantFormat& format, bool kernel) {
  if (format.is_unsigned() && x.numel() > 0 && x.min().item<double>() < 0.0) {
    throw Error("mdist::quant: " + format.str() + " got negative inputs");
  }
  const at::Tensor inputs = x.to(at::kFloat);
  const at::Tensor amax_f = amax.to(at::kFloat);
  const double min_amax = amax_f.min().item<double>();
  if (min_amax < 0.0) throw Error("mdist::quant: amax has negative values");
  // Built as modelopt builds it: a 0-d fp32 tensor on amax's device, so that maxbound / amax
  // is a tensor-tensor division on every device.
  const double bound = format.maxbound();
  const at::Tensor max_bound = at::scalar_tensor(bound, amax_f.options());
  const double min_bound = format.is_unsigned()    ? 0.0
                           : format.narrow_range() ? -bound
                                                   : -bound - 1.0;
  at::Tensor scale = max_bound / amax_f;
  const bool any_tiny = min_amax <= kTinyAmax;
  at::Tensor tiny;
  if (any_tiny) {
    // A zero scale quantizes everything to 0; dividing by 1 afterwards keeps it 0.
    tiny = amax_f <= kTinyAmax;
    scale.masked_fill_(tiny, 0.0);
  }
  // Unsigned formats keep the ATen path: their lower bound 0 makes the sign of a clamped zero
  // depend on the vectorized max's operand order.
  if (kernel && !format.is_unsigned() && detail::cpu_kernel_applies(x, scale)) {
    const at::Tensor divisor = any_tiny ? scale.masked_fill(tiny, 1.0) : scale;
    return detail::integer_fake_quant_cpu(x, scale, divisor, min_bound, bound);
  }
  at::Tensor outputs = at::clamp(at::round(inputs * scale), min_bound, bound);
  if (any_tiny) scale.masked_fill_(tiny, 1.0);
  return (outputs / scale).to(x.scalar_type());
}

// `_fp8_eager`: E4M3 fake quant with an amax that broadcasts against x.
at::Tensor e4m3_fake_quant(const at::Tensor& x, const at::Tensor& amax, bool kernel) {
  const at::Tensor amax_f = amax.to(at::kFloat);
  const at::Tensor safe_amax = at::where(amax_f <= kTinyAmax, at::ones_like(amax_f), amax_f);
  // Python's `448.0 / safe_amax` and `1 / scale` are Tensor.__rtruediv__: reciprocal, then
  // a multiplication (by 1, exact, for the second).
  const at::Tensor scale = at::reciprocal(safe_amax) * 448.0;
  const at::Tensor scale_inv = at::reciprocal(scale);
  if (kernel && detail::cpu_kernel_applies(x, scale)) {
    return detail::e4m3_fake_quant_cpu(x, scale, scale_inv);
  }
  const at::Tensor scaled = (x.to(at::kFloat) * scale).clamp(-448.0, 448.0);
  return (scaled.to(at::kFloat8_e4m3fn).to(at::kFloat) * scale_inv).to(x.scalar_type());
}

// E2M1 magnitude of |x| / s: the kernel's thresholds (ties go to the even code: 0.25 -> 0,
// 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; 6 and above -> 6).
at::Tensor e2m1_round_magnitude(const at::Tensor& a) {
  at::Tensor q = at::where(a <= 5.0, 4.0, 6.0);
  q = at::where(a < 3.5, 3.0, q);
  q = at::where(a <= 2.5, 2.0, q);
  q = at::where(a < 1.75, 1.5, q);
  q = at::where(a <= 1.25, 1.0, q);
  q = at::where(a < 0.75, 0.5, q);
  return at::where(a <= 0.25, 0.0, q);
}

at::Tensor nvfp4_forward(const at::Tensor& x, const at::Tensor& global_amax, bool kernel) {
  constexpr int64_t block = 16;
  const auto shape = x.sizes().vec();
  const int64_t n = x.size(-1);
  const at::Tensor rows = x.reshape({-1, n});
  // The wrapper's `global_amax.float() / (6.0 * 448.0)`: a division by a Python scalar.
  const at::Tensor global_scale = global_amax.to(at::kFloat) / 2688.0;
  const at::Tensor safe_global_scale =
      at::where(global_scale > 0.0, global_scale, at::scalar_tensor(1e-12, global_scale.options()));
  if (kernel && detail::cpu_kernel_applies(x, global_scale)) {
    // The same fp32 factors the ATen ops below use: the global scale and `gs * 6.0`.
    return detail::nvfp4_fake_quant_cpu(x, safe_global_scale.item<float>(),
                                        (safe_global_scale * 6.0).item<float>());
  }
  const int64_t pad = (block - n % block) % block;
  // The kernel loads a row's tail past n as zeros.
  const at::Tensor tile =
      at::constant_pad_nd(rows.to(at::kFloat), {0, pad}, 0.0).reshape({rows.size(0), -1, block});
  const at::Tensor x_abs = tile.abs();
  const at::Tensor block_max = std::get<0>(x_abs.max(-1, /*keepdim=*/true));
  at::Tensor scale = (block_max / (safe_global_scale * 6.0)).clamp_max(448.0);
  scale = scale.to(at::kFloat8_e4m3fn).to(at::kFloat) * safe_global_scale;
  scale = at::where(scale >= 1e-5, scale, at::scalar_tensor(1.0, scale.options()));
  const at::Tensor magnitude = e2m1_round_magnitude(x_abs / scale) * scale;
  const at::Tensor y = at::where(tile >= 0, magnitude, -magnitude);
  return y.reshape({rows.size(0), -1}).narrow(1, 0, n).to(x.scalar_type()).reshape(shape);
}

void check_x(const at::Tensor& x, const QuantFormat& format) {
  if (x.dim() == 0) {
    throw Error("mdist::quant: " + format.str() + " needs a tensor with dimensions, not a scalar");
  }
  if (!at::isFloatingType(x.scalar_type())) {
    throw Error("mdist::quant: fake quant needs a floating-point tensor, not " +
                std::string(c10::toString(x.scalar_type())));
  }
}

// Number of blocks of x under static blocks of `block` (rows padded to whole blocks).
int64_t num_blocks(const at::Tensor& x, int64_t block) {
  const int64_t n = x.size(-1);
  return n == 0 ? 0 : x.numel() / n * (n + detail::padding_to_blocks(n, block)) / block;
}

// amax in the shape modelopt broadcasts it in against `x` (x already in blocks for static
// blocks); 0-d stays 0-d.
at::Tensor broadcast_amax(const at::Tensor& x, const at::Tensor& amax, const QuantFormat& format,
                          int64_t expected, const char* what) {
  if (amax.numel() != expected) {
    throw Error("mdist::quant: " + format.str() + " needs " + std::to_string(expected) + " " +
                what + " for an input of shape " + shape_str(x) + ", got amax of shape " +
                shape_str(amax));
  }
  if (!at::isFloatingType(amax.scalar_type())) {
    throw Error("mdist::quant: amax must be floating point, not " +
                std::string(c10::toString(amax.scalar_type())));
  }
  const at::Tensor on_device = amax.device() == x.device() ? amax : amax.to(x.device());
  if (amax.dim() == 0 || format.axis() == Axis::per_tensor) return on_device;
  std::vector<int64_t> shape(static_cast<std::size_t>(x.dim()), 1);
  shape[0] = expected;
  return on_device.reshape(shape);
}

// The elementwise part: x (in blocks for static blocks) against its broadcast amax.
at::Tensor quantize_prepared(const at::Tensor& x, const at::Tensor& amax, const QuantFormat& format,
                             bool kernel = true) {
  if (format.is_nvfp4()) return nvfp4_forward(x, amax, kernel);
  if (format.is_e4m3()) return e4m3_fake_quant(x, amax, kernel);
  return integer_fake_quant(x, amax, format, kernel);
}

// What fake_quant and fake_quant_ste share around the elementwise part.
template <typename Quantize>
at::Tensor with_layout(const at::Tensor& x, const at::Tensor& amax, const QuantFormat& format,
                       const Quantize& quantize) {
  check_x(x, format);
  if (format.block_kind() == BlockKind::static_blocks) {
    const int64_t block = format.block_size();
    const at::Tensor blocks = detail::to_blocks(x, block);
    const at::Tensor amax_b =
        broadcast_amax(blocks, amax, format, num_blocks(x, block), "block amaxes");
    // Blocks are rows here: view amax as [blocks, 1].
    const at::Tensor amax_rows = amax_b.dim() == 0 ? amax_b : amax_b.reshape({-1, 1});
    return detail::from_blocks(quantize(blocks, amax_rows), x.sizes(), block);
  }
  if (format.axis() == Axis::per_row) {
    return quantize(x, broadcast_amax(x, amax, format, x.size(0), "row amaxes"));
  }
  return quantize(x, broadcast_amax(x, amax, format, 1, "amax element"));
}

}  // namespace

at::Tensor fake_quant(const at::Tensor& x, const at::Tensor& amax, const QuantFormat& format) {
  const at::NoGradGuard no_grad;
  return with_layout(
      x.detach(), amax.detach(), format,
      [&](const at::Tensor& xs, const at::Tensor& a) { return quantize_prepared(xs, a, format); });
}

namespace detail {

at::Tensor fake_quant_aten(const at::Tensor& x, const at::Tensor& amax, const QuantFormat& format) {
  const at::NoGradGuard no_grad;
  return with_layout(x.detach(), amax.detach(), format,
                     [&](const at::Tensor& xs, const at::Tensor& a) {
                       return quantize_prepared(xs, a, format, /*kernel=*/false);
                     });
}

}  // namespace detail

at::Tensor nvfp4_fake_quant(const at::Tensor& x, const at::Tensor& global_amax) {
  return fake_quant(x, global_amax, QuantFormat::nvfp4());
}

at::Tensor fake_quant_ste(const at::Tensor& x, const at::Tensor& amax, const QuantFormat& format,
                          Backward backward) {
  return with_layout(x, amax.detach(), format, [&](const at::Tensor& xs, const at::Tensor& a) {
    return FakeQuantFunction::apply(xs, a, format, backward);
  });
}

at::Tensor FakeQuantFunction::forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                      const at::Tensor& amax, const QuantFormat& format,
                                      Backward backward) {
  // modelopt saves nothing for the pass-through STE (it needs no inputs).
  if (backward == Backward::clipped) ctx->save_for_backward({x, amax});
  const at::NoGradGuard no_grad;
  return quantize_prepared(x, amax, format);
}

torch::autograd::variable_list FakeQuantFunction::backward(
    torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad_outputs) {
  const at::Tensor& grad = grad_outputs[0];
  const auto saved = ctx->get_saved_variables();
  if (saved.empty()) return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  // `_fake_tensor_quant_backward`: the comparison in the promoted dtype of x and amax, the
  // zero a one-element tensor of the gradient's dtype.
  const at::Tensor& x = saved[0];
  const at::Tensor& amax = saved[1];
  const at::Tensor grad_x = at::where(x.abs() <= amax, grad, grad.new_zeros({1}));
  return {grad_x, at::Tensor(), at::Tensor(), at::Tensor()};
}

}  // namespace mdist::quant
