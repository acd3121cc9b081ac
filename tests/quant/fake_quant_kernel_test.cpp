// The one-pass CPU fake-quant kernels (src/quant/fake_quant_cpu.h) against the ATen op
// sequence they replace (detail::fake_quant_aten, itself checked against modelopt by
// fake_quant_test): bit for bit, NaN payloads and signed zeros included, over random inputs
// and the edge cases of each format (NaN, infinities, subnormals, exact rounding ties, amax at
// and below 2^-24, per-row amax, static blocks with a padded tail, NVFP4's 1e-5 scale rule).
#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "mdist/quant/fake_quant.h"
#include "mdist/quant/format.h"
#include "src/quant/fake_quant_cpu.h"

namespace {

using mdist::quant::Axis;
using mdist::quant::Backward;
using mdist::quant::QuantFormat;
namespace detail = mdist::quant::detail;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Same dtype, shape and bits (so NaN against NaN and -0 against +0 count).
::testing::AssertionResult same_bits(const at::Tensor& actual, const at::Tensor& expected) {
  if (actual.scalar_type() != expected.scalar_type() || actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure() << actual.scalar_type() << actual.sizes() << " vs "
                                         << expected.scalar_type() << expected.sizes();
  }
  const at::Tensor a = actual.contiguous().view(at::kInt).reshape({-1});
  const at::Tensor e = expected.contiguous().view(at::kInt).reshape({-1});
  const at::Tensor differ = a != e;
  const int64_t count = differ.sum().item<int64_t>();
  if (count == 0) return ::testing::AssertionSuccess();
  const int64_t i = differ.nonzero()[0][0].item<int64_t>();
  return ::testing::AssertionFailure()
         << count << " of " << a.numel() << " elements differ; first at " << i << ": "
         << actual.reshape({-1})[i].item<float>() << " vs "
         << expected.reshape({-1})[i].item<float>();
}

// Random values over many magnitudes, then the edge values written over some of them.
at::Tensor random_input(std::vector<int64_t> shape, uint64_t seed) {
  at::manual_seed(seed);
  const at::Tensor base = at::randn(shape);
  const at::Tensor magnitude = at::pow(10.0, at::randint(-6, 4, shape).to(at::kFloat));
  at::Tensor x = (base * magnitude).contiguous();
  const std::vector<float> edges = {kNan,   -kNan,   kInf,   -kInf,  0.0f,    -0.0f,
                                    1e-40f, -1e-41f, 1e-45f, 3e38f,  -3e38f,  0.5f,
                                    -0.5f,  2.5f,    -1.5f,  448.0f, -448.0f, 6.0f};
  float* data = x.mutable_data_ptr<float>();
  for (std::size_t i = 0; i < edges.size() && static_cast<int64_t>(i * 7) < x.numel(); ++i) {
    data[i * 7] = edges[i];
  }
  return x;
}

void expect_same_paths(const at::Tensor& x, const at::Tensor& amax, const QuantFormat& format) {
  SCOPED_TRACE(format.str() + ", x " + std::to_string(x.numel()) + " elements");
  const at::Tensor expected = detail::fake_quant_aten(x, amax, format);
  EXPECT_TRUE(same_bits(mdist::quant::fake_quant(x, amax, format), expected));
  // The STE path's forward runs through the same kernels.
  for (const Backward backward : {Backward::pass_through, Backward::clipped}) {
    EXPECT_TRUE(
        same_bits(mdist::quant::fake_quant_ste(x, amax, format, backward).detach(), expected));
  }
}

// Per-row amax: ordinary rows from the data, and rows at, around and below the tiny-amax
// threshold 2^-24, zero, and NaN-free infinities' neighbours.
at::Tensor row_amax(const at::Tensor& rows) {
  at::Tensor amax = std::get<0>(rows.abs().nan_to_num(0.0, 1e30, 1e30).max(1)).contiguous();
  float* a = amax.mutable_data_ptr<float>();
  const std::vector<float> special = {0.0f,
                                      std::ldexp(1.0f, -24),
                                      std::ldexp(1.0f, -25),
                                      std::nextafter(std::ldexp(1.0f, -24), 1.0f),
                                      1e-30f,
                                      127.0f,
                                      448.0f,
                                      3.0e38f};
  for (std::size_t i = 0; i < special.size() && static_cast<int64_t>(i) < amax.numel(); ++i) {
    a[i] = special[i];
  }
  return amax;
}

TEST(FakeQuantKernel, AppliesToContiguousFp32OnTheCpuOnly) {
  const at::Tensor x = at::randn({4, 32});
  EXPECT_TRUE(detail::cpu_kernel_applies(x, at::scalar_tensor(1.0)));
  EXPECT_TRUE(detail::cpu_kernel_applies(x, at::ones({4, 1})));
  EXPECT_TRUE(detail::cpu_kernel_applies(x, at::ones({1})));
  EXPECT_FALSE(detail::cpu_kernel_applies(x.to(at::kBFloat16), at::scalar_tensor(1.0)));
  EXPECT_FALSE(detail::cpu_kernel_applies(x.t(), at::scalar_tensor(1.0)));
  EXPECT_FALSE(detail::cpu_kernel_applies(x, at::ones({1, 32})));
  EXPECT_FALSE(detail::cpu_kernel_applies(x, at::ones({1, 1, 1})));
  EXPECT_FALSE(detail::cpu_kernel_applies(x.narrow(0, 0, 0), at::scalar_tensor(1.0)));
}

TEST(FakeQuantKernel, E4m3PerTensorAndPerRowMatchTheAtenOps) {
  const QuantFormat per_tensor = QuantFormat::fp8();
  const QuantFormat per_row = QuantFormat::fp8().with_axis(Axis::per_row);
  for (uint64_t seed = 0; seed < 4; ++seed) {
    const at::Tensor x = random_input({37, 129}, seed);
    for (const float amax : {1.0f, 448.0f, 3.7e-3f, 0.0f, std::ldexp(1.0f, -24), 1e-30f, 2e38f}) {
      expect_same_paths(x, at::scalar_tensor(amax), per_tensor);
    }
    expect_same_paths(x, row_amax(x), per_row);
    // An activation: per tensor over a 3-d input.
    expect_same_paths(random_input({2, 9, 48}, seed + 10), at::scalar_tensor(5.0f), per_tensor);
  }
  // Midpoints between neighbouring E4M3 values (ties to even), under a unit-ish scale.
  std::vector<float> mids;
  for (int code = 0; code < 126; ++code) {
    const float lo = static_cast<float>(
        c10::Float8_e4m3fn(static_cast<uint8_t>(code), c10::Float8_e4m3fn::from_bits()));
    const float hi = static_cast<float>(
        c10::Float8_e4m3fn(static_cast<uint8_t>(code + 1), c10::Float8_e4m3fn::from_bits()));
    mids.push_back((lo + hi) / 2);
    mids.push_back(-(lo + hi) / 2);
  }
  const at::Tensor ties = at::tensor(mids).reshape({2, -1}).contiguous();
  expect_same_paths(ties, at::scalar_tensor(448.0f), per_tensor);
}

TEST(FakeQuantKernel, IntegersPerTensorPerRowAndBlocksMatchTheAtenOps) {
  const std::vector<QuantFormat> formats = {QuantFormat::int8(), QuantFormat::int8_per_row(),
                                            QuantFormat::integer(8, false, true),
                                            QuantFormat::integer(4).with_axis(Axis::per_row)};
  for (uint64_t seed = 0; seed < 4; ++seed) {
    const at::Tensor x = random_input({23, 77}, seed);
    for (const QuantFormat& format : formats) {
      if (format.axis() == Axis::per_row) {
        expect_same_paths(x, row_amax(x), format);
      } else {
        for (const float amax : {1.0f, 127.0f, 0.0f, std::ldexp(1.0f, -24), 1e-30f, 5e-3f}) {
          expect_same_paths(x, at::scalar_tensor(amax), format);
        }
      }
    }
    // Static blocks (INT4 AWQ's 128), the last of each row padded: one amax per block.
    for (const int64_t block : {int64_t{128}, int64_t{16}}) {
      const QuantFormat format = QuantFormat::int4_blocks(block);
      const at::Tensor w = random_input({6, 200}, seed + 20);
      const int64_t blocks = 6 * ((200 + block - 1) / block);
      const at::Tensor padded = at::constant_pad_nd(w, {0, (block - 200 % block) % block}, 0.0);
      expect_same_paths(w, row_amax(padded.reshape({blocks, block})), format);
    }
  }
  // Exact ties: amax 127 makes int8's scale exactly 1, so k + 0.5 rounds to the even k.
  const at::Tensor ties = (at::arange(-140, 140).to(at::kFloat) + 0.5f).reshape({4, -1});
  expect_same_paths(ties.contiguous(), at::scalar_tensor(127.0f), QuantFormat::int8());
}

TEST(FakeQuantKernel, Nvfp4MatchesTheAtenOps) {
  const QuantFormat nvfp4 = QuantFormat::nvfp4();
  for (uint64_t seed = 0; seed < 4; ++seed) {
    for (const std::vector<int64_t>& shape :
         {std::vector<int64_t>{19, 64}, std::vector<int64_t>{5, 40}, {2, 3, 48}}) {
      const at::Tensor x = random_input(shape, seed);
      for (const float amax : {2688.0f, 1.0f, 300.0f, 0.0f, 1e-20f, 3e-5f, 3e38f}) {
        expect_same_paths(x, at::scalar_tensor(amax), nvfp4);
      }
    }
  }
  // Global scale 1 (amax 2688) and a block whose max is 6: block scale 1, so the E2M1
  // thresholds are hit exactly (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 and their neighbours).
  std::vector<float> row = {6.0f,   0.25f,  0.75f,  1.25f,  1.75f, 2.5f,  3.5f,  5.0f,
                            -0.25f, -0.75f, -1.25f, -1.75f, -2.5f, -3.5f, -5.0f, -0.0f};
  for (const float t : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f}) {
    row.push_back(std::nextafter(t, 0.0f));
    row.push_back(-std::nextafter(t, 10.0f));
  }
  expect_same_paths(at::tensor(row).reshape({1, -1}).contiguous(), at::scalar_tensor(2688.0f),
                    nvfp4);
  // The block-scale rule `scale >= 1e-5`: a global amax whose scale is fp32's 1e-5, and a
  // block whose scale lands on it exactly (E4M3 code 1).
  float amax = 1e-5f * 2688.0f;
  for (int i = 0; i < 64; ++i) {
    const float gs = (at::scalar_tensor(amax) / 2688.0).item<float>();
    if (gs == 1e-5f) break;
    amax = std::nextafter(amax, gs < 1e-5f ? kInf : 0.0f);
  }
  ASSERT_EQ((at::scalar_tensor(amax) / 2688.0).item<float>(), 1e-5f);
  const at::Tensor edge =
      at::tensor(std::vector<float>{6e-5f, 3e-5f, 1e-5f, -2e-5f, 5e-6f, 0.0f, 1e-6f, 4e-5f, 6e-5f,
                                    3e-5f, 1e-5f, -2e-5f, 5e-6f, 0.0f, 1e-6f, 4e-5f})
          .reshape({1, 16});
  expect_same_paths(edge.contiguous(), at::scalar_tensor(amax), nvfp4);
}

}  // namespace
