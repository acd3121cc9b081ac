// One-pass CPU fake-quant kernels: see src/quant/fake_quant_cpu.h. Every expression below
// mirrors one ATen op of fake_quant.cpp in fp32, in its order; the comments name the op.
#include "src/quant/fake_quant_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace mdist::quant::detail {
namespace {

// Elements per parallel task: large enough that thread start-up does not dominate.
constexpr int64_t kGrain = 1 << 16;

// at::clamp / clamp_max on fp32: min(max(v, lo), hi), NaN propagated (std::max and std::min
// return their first argument when a comparison with NaN is false).
inline float clamp_nan(float v, float lo, float hi) { return std::min(std::max(v, lo), hi); }

// `.to(kFloat8_e4m3fn).to(kFloat)`: c10's conversions, which ATen's casts use.
inline float through_e4m3(float v) { return static_cast<float>(c10::Float8_e4m3fn(v)); }

// The same for a v already clamped to [-448, 448] (or NaN), in float arithmetic the compiler
// can vectorize: E4M3 keeps 3 mantissa bits from its smallest normal 2^-6 on and multiples of
// 2^-9 below it, both rounded half to even, and the sign (a zero keeps it too). NaN goes
// through c10, whose NaN bits are then those of ATen's casts.
inline float clamped_through_e4m3(float v) {
  if (std::isnan(v)) return through_e4m3(v);
  const float a = std::fabs(v);
  float r;
  if (a < 0.015625f) {
    // fp32's spacing at 2^14 is 2^-9: the addition rounds a to that grid, half to even.
    r = (a + 16384.0f) - 16384.0f;
  } else {
    auto u = std::bit_cast<uint32_t>(a);
    u += 0x7FFFFu + ((u >> 20) & 1u);  // half to even on the 20 dropped mantissa bits
    r = std::bit_cast<float>(u & 0xFFF00000u);
  }
  return std::copysign(r, v);
}

// at::round on fp32 (round half to even, -0 kept): below 2^23 adding and subtracting 2^23
// rounds to an integer in the default rounding mode; from 2^23 on every float is an integer
// (and NaN and infinities are their own rounding).
inline float round_half_even(float v) {
  const float a = std::fabs(v);
  return a < 8388608.0f ? std::copysign((a + 8388608.0f) - 8388608.0f, v) : v;
}

// y[i] = op(x[i], a[row], b[row]) over x viewed as a.numel() rows of equal length.
template <typename Op>
at::Tensor per_row(const at::Tensor& x, const at::Tensor& a_in, const at::Tensor& b_in, Op op) {
  const at::Tensor a = a_in.contiguous();
  const at::Tensor b = b_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const float* xs = x.const_data_ptr<float>();
  const float* as = a.const_data_ptr<float>();
  const float* bs = b.const_data_ptr<float>();
  float* ys = y.mutable_data_ptr<float>();
  const int64_t n = x.numel();
  const int64_t cols = n / a.numel();
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end;) {
      const int64_t row = i / cols;
      const int64_t stop = std::min(end, (row + 1) * cols);
      const float fa = as[row];
      const float fb = bs[row];
      for (; i < stop; ++i) ys[i] = op(xs[i], fa, fb);
    }
  });
  return y;
}

}  // namespace

bool cpu_kernel_applies(const at::Tensor& x, const at::Tensor& factors) {
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || !x.is_contiguous() || x.dim() == 0 ||
      x.numel() == 0) {
    return false;
  }
  if (!factors.device().is_cpu() || factors.scalar_type() != at::kFloat ||
      factors.dim() > x.dim()) {
    return false;
  }
  if (factors.numel() == 1) return true;
  // [rows, 1, ...] against x [rows, ...]: the broadcast keeps x's shape.
  return factors.dim() == x.dim() && factors.size(0) == x.size(0) && factors.numel() == x.size(0);
}

at::Tensor e4m3_fake_quant_cpu(const at::Tensor& x, const at::Tensor& scale,
                               const at::Tensor& scale_inv) {
  return per_row(x, scale, scale_inv, [](float v, float s, float s_inv) {
    // (x * scale).clamp(-448, 448), to E4M3 and back, * scale_inv.
    return clamped_through_e4m3(clamp_nan(v * s, -448.0f, 448.0f)) * s_inv;
  });
}

at::Tensor integer_fake_quant_cpu(const at::Tensor& x, const at::Tensor& scale,
                                  const at::Tensor& divisor, double min_bound, double max_bound) {
  const auto lo = static_cast<float>(min_bound);
  const auto hi = static_cast<float>(max_bound);
  return per_row(x, scale, divisor, [lo, hi](float v, float s, float d) {
    // clamp(round(x * scale), min, max) / divisor.
    return clamp_nan(round_half_even(v * s), lo, hi) / d;
  });
}

at::Tensor nvfp4_fake_quant_cpu(const at::Tensor& x, float global_scale, float divisor) {
  constexpr int64_t kBlock = 16;
  at::Tensor y = at::empty_like(x);
  const float* xs = x.const_data_ptr<float>();
  float* ys = y.mutable_data_ptr<float>();
  const int64_t n = x.size(-1);
  const int64_t rows = x.numel() / n;
  const int64_t blocks_per_row = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, rows * blocks_per_row, std::max<int64_t>(1, kGrain / kBlock),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t b = begin; b < end; ++b) {
                       const int64_t row = b / blocks_per_row;
                       const int64_t first = row * n + (b % blocks_per_row) * kBlock;
                       const int64_t last = std::min(first + kBlock, (row + 1) * n);
                       // x_abs.max(-1): the padded tail's zeros take part; NaN propagates.
                       float block_max = 0.0f;
                       for (int64_t i = first; i < last; ++i) {
                         const float a = std::fabs(xs[i]);
                         if (std::isnan(a) || std::isnan(block_max)) {
                           block_max = std::isnan(block_max) ? block_max : a;
                         } else if (a > block_max) {
                           block_max = a;
                         }
                       }
                       // (block_max / (gs * 6)).clamp_max(448), to E4M3 and back, * gs;
                       // where(scale >= 1e-5, scale, 1) compares in fp32.
                       float s = through_e4m3(clamp_nan(block_max / divisor, -INFINITY, 448.0f)) *
                                 global_scale;
                       s = s >= 1e-5f ? s : 1.0f;
                       for (int64_t i = first; i < last; ++i) {
                         // e2m1_round_magnitude(x_abs / scale) * scale, then the sign of x.
                         const float a = std::fabs(xs[i]) / s;
                         float q = a <= 5.0f ? 4.0f : 6.0f;
                         if (a < 3.5f) q = 3.0f;
                         if (a <= 2.5f) q = 2.0f;
                         if (a < 1.75f) q = 1.5f;
                         if (a <= 1.25f) q = 1.0f;
                         if (a < 0.75f) q = 0.5f;
                         if (a <= 0.25f) q = 0.0f;
                         const float magnitude = q * s;
                         ys[i] = xs[i] >= 0.0f ? magnitude : -magnitude;
                       }
                     }
                   });
  return y;
}

}  // namespace mdist::quant::detail
