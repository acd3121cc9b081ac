// mdist::quant's fake quant and TensorQuantizer against numbers produced by modelopt 0.47
// itself (tests/quant/make_fixtures.py, which says how each case was configured and which
// modelopt function produced it). Everything is compared bit for bit (torch::equal and the
// same dtype): the C++ side repeats modelopt's op sequence, so no tolerance is needed.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "mdist/error.h"
#include "mdist/hf/safetensors.h"
#include "mdist/quant/fake_quant.h"
#include "mdist/quant/format.h"
#include "mdist/quant/tensor_quantizer.h"

namespace {

using mdist::quant::Axis;
using mdist::quant::QuantFormat;
using mdist::quant::TensorQuantizer;
using mdist::quant::TensorQuantizerOptions;
using Mode = mdist::quant::TensorQuantizerImpl::Mode;
using ::testing::HasSubstr;

const mdist::hf::SafetensorsFile& fixtures() {
  static const mdist::hf::SafetensorsFile file(std::filesystem::path(MDIST_QUANT_FIXTURES) /
                                               "tensor_quantizer.safetensors");
  return file;
}

// A writable copy (the file's tensors alias a read-only mapping).
at::Tensor get(const std::string& name) { return fixtures().tensor(name).clone(); }
bool has(const std::string& name) { return fixtures().contains(name); }

// Bit-exact: same dtype, same shape, same values (NaN never expected here).
::testing::AssertionResult same(const at::Tensor& actual, const at::Tensor& expected) {
  if (actual.scalar_type() != expected.scalar_type()) {
    return ::testing::AssertionFailure()
           << "dtype " << actual.scalar_type() << " vs " << expected.scalar_type();
  }
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << "shape " << actual.sizes() << " vs " << expected.sizes();
  }
  if (!at::equal(actual, expected)) {
    const at::Tensor diff = actual.to(at::kDouble) != expected.to(at::kDouble);
    return ::testing::AssertionFailure()
           << diff.sum().item<int64_t>() << " of " << actual.numel() << " elements differ; "
           << "max |diff| " << (actual.to(at::kDouble) - expected.to(at::kDouble)).abs().max();
  }
  return ::testing::AssertionSuccess();
}

// CASE.meta (make_fixtures.py): kind, bits/exponent, mantissa, axis, block kind, block size,
// calibrated, has pre_quant_scale.
struct Meta {
  int64_t kind, bits, mantissa, axis, block_kind, block_size, calibrated, has_pqs;
};
constexpr int64_t kFloat = 1, kSequentialW4A8 = 2;
constexpr int64_t kCalibratedOnBatches = 1, kCalibratedOnX = 2;

Meta meta_of(const std::string& name) {
  const at::Tensor m = get(name + ".meta");
  const auto v = [&](int64_t i) { return m[i].item<int64_t>(); };
  return {v(0), v(1), v(2), v(3), v(4), v(5), v(6), v(7)};
}

QuantFormat format_of(const Meta& m) {
  if (m.kind == kFloat && m.bits == 2) return QuantFormat::nvfp4();
  QuantFormat format = m.kind == kFloat ? QuantFormat::floating(static_cast<int>(m.bits),
                                                                static_cast<int>(m.mantissa))
                                        : QuantFormat::integer(static_cast<int>(m.bits));
  if (m.axis == 0) format = format.with_axis(Axis::per_row);
  if (m.block_kind == 1) format = format.with_static_blocks(m.block_size);
  return format;
}

std::vector<at::Tensor> calibration_batches(const std::string& name, const Meta& m) {
  if (m.calibrated == kCalibratedOnX) return {get(name + ".x")};
  std::vector<at::Tensor> batches;
  for (int i = 0; has(name + ".calib" + std::to_string(i)); ++i) {
    batches.push_back(get(name + ".calib" + std::to_string(i)));
  }
  return batches;
}

// Configures quantizer q for case `name` as make_fixtures.py configured modelopt's.
void prepare(TensorQuantizer& q, const std::string& name, const Meta& m) {
  if (m.has_pqs) q->set_pre_quant_scale(get(name + ".pqs"));
  if (m.calibrated != 0) {
    q->set_mode(Mode::calibrate);
    for (const at::Tensor& batch : calibration_batches(name, m)) {
      EXPECT_TRUE(same(q(batch), m.has_pqs ? batch * get(name + ".pqs") : batch))
          << "calibrate mode returns its input";
    }
    q->load_calib_amax();
    q->set_mode(Mode::quantize);
  } else {
    q->set_amax(get(name + ".amax"));
  }
}

const char* const kCases[] = {
    "fp8_f32",          "fp8_bf16",           "fp8_bf16_calib",       "fp8_tiny_amax",
    "int8_row_calib",   "int8_row_ties",      "int8_tensor_bf16_pqs", "int8_tensor_bf16",
    "int4_blk128",      "int4_blk128_bf16",   "int4_blk128_pad",      "nvfp4_f32",
    "nvfp4_bf16_calib", "nvfp4_small_scales", "nvfp4_zero_amax",      "nvfp4_pad",
};

class ModeloptCase : public ::testing::TestWithParam<const char*> {};

// The pure function against modelopt's forward, with modelopt's amax.
TEST_P(ModeloptCase, FakeQuantEqualsModelopt) {
  const std::string name = GetParam();
  const Meta m = meta_of(name);
  const at::Tensor x = m.has_pqs ? get(name + ".x") * get(name + ".pqs") : get(name + ".x");
  EXPECT_TRUE(
      same(mdist::quant::fake_quant(x, get(name + ".amax"), format_of(m)), get(name + ".y")));
}

// The quantizer end to end: amax (set, or calibrated with the same batches), forward, and the
// input gradient with the clipped and with the pass-through STE.
TEST_P(ModeloptCase, TensorQuantizerEqualsModelopt) {
  const std::string name = GetParam();
  const Meta m = meta_of(name);
  for (const bool pass_through : {false, true}) {
    SCOPED_TRACE(pass_through ? "pass_through_bwd" : "clipped STE");
    TensorQuantizer q(format_of(m), TensorQuantizerOptions{.pass_through_bwd = pass_through});
    prepare(q, name, m);
    EXPECT_TRUE(same(q->amax(), get(name + ".amax")));
    const at::Tensor x = get(name + ".x").requires_grad_(true);
    const at::Tensor y = q(x);
    EXPECT_TRUE(same(y, get(name + ".y")));
    y.backward(get(name + ".grad_out"));
    const std::string expected = !pass_through ? ".grad_clip"
                                 : m.has_pqs   ? ".grad_ptb"
                                               : ".grad_out";
    EXPECT_TRUE(same(x.grad(), get(name + expected)));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ModeloptCase, ::testing::ValuesIn(kCases));

// W4A8's weight quantizer: modelopt's SequentialQuantizer of INT4 blocks of 128 and FP8 per
// tensor, both calibrated on the weight (the first passes its input on while calibrating).
TEST(W4A8, SequentialEqualsModelopt) {
  const at::Tensor w = get("w4a8_seq.x");
  for (const bool pass_through : {false, true}) {
    TensorQuantizer int4(QuantFormat::int4_blocks(128),
                         TensorQuantizerOptions{.pass_through_bwd = pass_through});
    TensorQuantizer fp8(QuantFormat::fp8(),
                        TensorQuantizerOptions{.pass_through_bwd = pass_through});
    int4->set_mode(Mode::calibrate);
    fp8->set_mode(Mode::calibrate);
    fp8(int4(w));
    int4->load_calib_amax();
    fp8->load_calib_amax();
    int4->set_mode(Mode::quantize);
    fp8->set_mode(Mode::quantize);
    EXPECT_TRUE(same(int4->amax(), get("w4a8_seq.amax0")));
    EXPECT_TRUE(same(fp8->amax(), get("w4a8_seq.amax1")));
    const at::Tensor x = w.clone().requires_grad_(true);
    const at::Tensor y = fp8(int4(x));
    EXPECT_TRUE(same(y, get("w4a8_seq.y")));
    y.backward(get("w4a8_seq.grad_out"));
    EXPECT_TRUE(same(x.grad(), get(pass_through ? "w4a8_seq.grad_out" : "w4a8_seq.grad_clip")));
  }
}

// modelopt's own CPU code for NVFP4 (NVFP4QTensor.quantize then .dequantize, the export path)
// on blocks whose scales stay above both implementations' floors.
TEST(Nvfp4, EqualsModeloptQTensorRoundTrip) {
  for (const std::string name : {"nvfp4_qtensor_f32", "nvfp4_qtensor_bf16"}) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(same(mdist::quant::nvfp4_fake_quant(get(name + ".x"), get(name + ".amax")),
                     get(name + ".y")));
  }
}

// MaxCalibrator: the running max over batches, per output row.
TEST(Calibrate, RunningMaxPerRowOverBatches) {
  TensorQuantizer q(QuantFormat::int8_per_row());
  q->set_mode(Mode::calibrate);
  for (int i = 0; i < 3; ++i) q(get("calib_row.calib" + std::to_string(i)));
  q->load_calib_amax();
  EXPECT_TRUE(same(q->amax(), get("calib_row.amax")));
  EXPECT_THAT(q->amax().sizes(), ::testing::ElementsAre(6, 1));
  // Loading again after more batches copies into the same buffer.
  q(get("calib_row.calib1") * 3.0);
  q->load_calib_amax();
  EXPECT_TRUE(same(q->amax(), at::maximum(get("calib_row.amax"),
                                          get("calib_row.calib1").abs().amax(1, true) * 3.0)));
}

TEST(Calibrate, RefusesNaNAndInfinity) {
  for (const double bad : {std::nan(""), double{INFINITY}, -double{INFINITY}}) {
    TensorQuantizer q(QuantFormat::int8_per_row());
    q->set_mode(Mode::calibrate);
    q(at::ones({2, 4}));
    at::Tensor x = at::ones({2, 4});
    x[1][2].fill_(bad);
    try {
      q(x);
      ADD_FAILURE() << "no error for " << bad;
    } catch (const mdist::Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(std::isnan(bad) ? "NaN" : "infinite"));
      EXPECT_THAT(e.what(), HasSubstr("int8 per-row"));
    }
    // The running max is untouched by the refused batch.
    q->load_calib_amax();
    EXPECT_TRUE(same(q->amax(), at::ones({2, 1})));
  }
}

TEST(Calibrate, PerTensorScalarAndStaticBlocks) {
  TensorQuantizer per_tensor(QuantFormat::fp8());
  per_tensor->set_mode(Mode::calibrate);
  per_tensor(at::tensor({-3.0F, 1.0F}));
  per_tensor(at::tensor({2.0F, -1.0F}));
  per_tensor->load_calib_amax();
  EXPECT_TRUE(same(per_tensor->amax(), at::scalar_tensor(3.0F)));

  TensorQuantizer blocks(QuantFormat::int4_blocks(4));
  blocks->set_mode(Mode::calibrate);
  // 6 columns: two blocks per row, the second padded with zeros.
  blocks(at::tensor({1.0F, -5.0F, 2.0F, 0.5F, -7.0F, 3.0F}).reshape({1, 6}));
  blocks->load_calib_amax();
  EXPECT_TRUE(same(blocks->amax(), at::tensor({5.0F, 7.0F}).reshape({2, 1})));
}

TEST(TensorQuantizer, ForwardOrderAndModes) {
  TensorQuantizer q(QuantFormat::int8());
  // An empty input comes back as it is, even before any amax exists.
  const at::Tensor empty = at::empty({0, 8});
  EXPECT_TRUE(q(empty).is_same(empty));
  // Disabled: x * pre_quant_scale, not quantized.
  q->set_pre_quant_scale(at::full({3}, 0.5F));
  q->set_mode(Mode::disabled);
  EXPECT_FALSE(q->is_enabled());
  const at::Tensor x = at::tensor({1.0F, 2.0F, 0.3F});
  EXPECT_TRUE(same(q(x), x * 0.5F));
  // Quantize without an amax: the input's own max, as modelopt's dynamic amax.
  q->set_mode(Mode::quantize);
  EXPECT_TRUE(
      same(q(x), mdist::quant::fake_quant(x * 0.5F, at::scalar_tensor(1.0F), QuantFormat::int8())));
}

TEST(TensorQuantizer, BuffersUnderModeloptNames) {
  struct Linear : torch::nn::Module {
    Linear() {
      weight_quantizer =
          register_module("weight_quantizer", TensorQuantizer(QuantFormat::int8_per_row()));
      input_quantizer = register_module("input_quantizer", TensorQuantizer(QuantFormat::int8()));
    }
    TensorQuantizer weight_quantizer{nullptr}, input_quantizer{nullptr};
  };
  Linear linear;
  EXPECT_TRUE(linear.named_buffers().is_empty());  // no buffer before a value, as modelopt
  linear.weight_quantizer->set_amax(at::ones({4, 1}));
  linear.input_quantizer->set_amax(at::scalar_tensor(2.0));
  linear.input_quantizer->set_pre_quant_scale(at::ones({8}));
  EXPECT_THAT(linear.named_buffers().keys(),
              ::testing::UnorderedElementsAre("weight_quantizer._amax", "input_quantizer._amax",
                                              "input_quantizer._pre_quant_scale"));
  // Setting again copies into the registered buffer.
  linear.weight_quantizer->set_amax(at::full({4, 1}, 3.0));
  EXPECT_TRUE(same(linear.named_buffers()["weight_quantizer._amax"], at::full({4, 1}, 3.0F)));
}

// Messages of bad input: each names what is wrong.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const mdist::Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(BadInput, Formats) {
  EXPECT_THAT(error_of([] { QuantFormat::integer(1); }), HasSubstr("2 to 16 bits, not 1"));
  EXPECT_THAT(error_of([] { QuantFormat::floating(5, 2); }),
              HasSubstr("float format E5M2 is not supported"));
  EXPECT_THAT(error_of([] { QuantFormat::floating(2, 1); }), HasSubstr("QuantFormat::nvfp4()"));
  EXPECT_THAT(error_of([] { QuantFormat::int8_per_row().with_static_blocks(128); }),
              HasSubstr("blocks and an axis are exclusive"));
  EXPECT_THAT(error_of([] { QuantFormat::int4_blocks(128).with_axis(Axis::per_row); }),
              HasSubstr("blocks and an axis are exclusive"));
  EXPECT_THAT(error_of([] { QuantFormat::integer(4).with_static_blocks(0); }),
              HasSubstr("block size must be positive, not 0"));
  EXPECT_THAT(error_of([] { QuantFormat::nvfp4().with_static_blocks(16); }),
              HasSubstr("no static blocks"));
}

TEST(BadInput, FakeQuant) {
  const at::Tensor x = at::ones({3, 8});
  EXPECT_THAT(error_of([&] {
                mdist::quant::fake_quant(x, at::ones({4, 1}), QuantFormat::int8_per_row());
              }),
              HasSubstr("int8 per-row needs 3 row amaxes for an input of shape [3, 8], got "
                        "amax of shape [4, 1]"));
  EXPECT_THAT(
      error_of([&] { mdist::quant::fake_quant(x, at::ones({3}), QuantFormat::int4_blocks(4)); }),
      HasSubstr("int4 static blocks of 4 needs 6 block amaxes"));
  EXPECT_THAT(error_of([&] { mdist::quant::fake_quant(x, at::ones({2}), QuantFormat::fp8()); }),
              HasSubstr("needs 1 amax element"));
  EXPECT_THAT(
      error_of([&] { mdist::quant::fake_quant(x, at::scalar_tensor(-1.0), QuantFormat::int8()); }),
      HasSubstr("amax has negative values"));
  EXPECT_THAT(error_of([&] {
                mdist::quant::fake_quant(-x, at::scalar_tensor(1.0), QuantFormat::integer(8, true));
              }),
              HasSubstr("uint8 per-tensor got negative inputs"));
  EXPECT_THAT(error_of([&] {
                mdist::quant::fake_quant(at::scalar_tensor(1.0), at::scalar_tensor(1.0),
                                         QuantFormat::fp8());
              }),
              HasSubstr("not a scalar"));
  EXPECT_THAT(error_of([&] {
                mdist::quant::fake_quant(at::ones({2}, at::kInt), at::scalar_tensor(1.0),
                                         QuantFormat::fp8());
              }),
              HasSubstr("floating-point tensor"));
}

TEST(BadInput, TensorQuantizer) {
  TensorQuantizer q(QuantFormat::int4_blocks(4));
  EXPECT_THAT(error_of([&] { q->load_calib_amax(); }), HasSubstr("has collected nothing"));
  q->set_amax(at::ones({2, 1}));
  EXPECT_THAT(error_of([&] {
                q->set_amax(at::ones({3, 1}));
              }),
              HasSubstr("amax has shape [2, 1]; it cannot be set to one of shape [3, 1]"));
  q(at::ones({1, 8}));
  EXPECT_THAT(error_of([&] {
                q(at::ones({2, 4}));
              }),
              HasSubstr("input shape changed from [1, 8] to [2, 4]"));
}

TEST(Format, MaxboundAsModelopt) {
  EXPECT_EQ(QuantFormat::fp8().maxbound(), 448.0);
  EXPECT_EQ(QuantFormat::nvfp4().maxbound(), 6.0);
  EXPECT_EQ(QuantFormat::int8().maxbound(), 127.0);
  EXPECT_EQ(QuantFormat::integer(8, /*is_unsigned=*/true).maxbound(), 255.0);
  EXPECT_EQ(QuantFormat::int4_blocks().maxbound(), 7.0);
  EXPECT_EQ(QuantFormat::nvfp4().block_size(), 16);
  EXPECT_EQ(QuantFormat::int4_blocks().str(), "int4 static blocks of 128");
  EXPECT_EQ(QuantFormat::int8_per_row().str(), "int8 per-row");
}

// Narrow range and unsigned integers are not in modelopt's presets and so not in the fixture;
// their ranges are checked on values whose quantization is exact.
TEST(FakeQuant, IntegerRanges) {
  const at::Tensor x = at::tensor({-200.0F, -127.5F, 0.0F, 127.5F, 300.0F});
  const at::Tensor amax = at::scalar_tensor(127.0F);
  EXPECT_TRUE(same(mdist::quant::fake_quant(x, amax, QuantFormat::int8()),
                   at::tensor({-128.0F, -128.0F, 0.0F, 127.0F, 127.0F})));
  EXPECT_TRUE(same(mdist::quant::fake_quant(x, amax, QuantFormat::integer(8, false, true)),
                   at::tensor({-127.0F, -127.0F, 0.0F, 127.0F, 127.0F})));
}

// The straight-through estimator, per format, independently of modelopt's fixture: with the
// clipped backward the input gradient is the output gradient exactly where |x| <= amax (the
// element's own amax: per tensor, per row, per block; NVFP4 the global amax) and exactly 0
// where |x| > amax; with the pass-through backward it is the output gradient everywhere. The
// inputs hold elements exactly at +-amax (kept), just beyond (zeroed) and far beyond.
struct SteCase {
  const char* name;
  QuantFormat format;
  at::Tensor x;      // [rows, cols]
  at::Tensor amax;   // as the format takes it
  at::Tensor bound;  // amax broadcast to x's shape
};

std::vector<SteCase> ste_cases() {
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  const auto input = [&](int64_t rows, int64_t cols) { return at::randn({rows, cols}, gen) * 2.0; };
  std::vector<SteCase> cases;
  {
    at::Tensor x = input(4, 32);
    const at::Tensor amax = at::scalar_tensor(1.5F);
    x[0][0] = 1.5F;
    x[0][1] = -1.5F;
    x[0][2] = std::nextafter(1.5F, 2.0F);
    x[0][3] = -7.0F;
    cases.push_back({"fp8 per tensor", QuantFormat::fp8(), x, amax, amax.expand_as(x)});
    cases.push_back({"int8 per tensor", QuantFormat::int8(), x, amax, amax.expand_as(x)});
  }
  {
    at::Tensor x = input(4, 32);
    const at::Tensor amax = at::tensor({0.5F, 1.0F, 2.0F, 4.0F}).reshape({4, 1});
    x[1][0] = 1.0F;
    x[1][1] = std::nextafter(-1.0F, -2.0F);
    x[3][5] = -4.0F;
    cases.push_back({"int8 per row", QuantFormat::int8_per_row(), x, amax, amax.expand_as(x)});
  }
  {
    // Two rows of 256: four blocks of 128, one amax each (row-major).
    at::Tensor x = input(2, 256);
    const at::Tensor amax = at::tensor({0.75F, 3.0F, 1.25F, 0.25F});
    x[0][127] = 0.75F;
    x[0][128] = std::nextafter(3.0F, 4.0F);
    x[1][255] = -0.25F;
    const at::Tensor bound = amax.reshape({4, 1}).expand({4, 128}).reshape({2, 256});
    cases.push_back({"int4 blocks of 128", QuantFormat::int4_blocks(), x, amax, bound});
  }
  {
    at::Tensor x = input(2, 32);
    const at::Tensor amax = at::scalar_tensor(2.5F);
    x[0][0] = 2.5F;
    x[1][31] = std::nextafter(-2.5F, -3.0F);
    cases.push_back({"nvfp4 global amax", QuantFormat::nvfp4(), x, amax, amax.expand_as(x)});
  }
  return cases;
}

TEST(Ste, ClippedZeroExactlyBeyondAmaxPassThroughIdentity) {
  for (const auto& c : ste_cases()) {
    SCOPED_TRACE(c.name);
    const at::Tensor inside = c.x.abs() <= c.bound;
    // Both kinds of element are present, so the test can fail either way.
    ASSERT_TRUE(inside.any().item<bool>());
    ASSERT_TRUE(inside.logical_not().any().item<bool>());
    const at::Tensor grad_out =
        at::randn(c.x.sizes(), at::make_generator<at::CPUGeneratorImpl>(5)) + 3.0;  // none 0
    for (const auto backward :
         {mdist::quant::Backward::clipped, mdist::quant::Backward::pass_through}) {
      const at::Tensor x = c.x.clone().requires_grad_(true);
      const at::Tensor y = mdist::quant::fake_quant_ste(x, c.amax, c.format, backward);
      // The forward is fake_quant's.
      EXPECT_TRUE(same(y.detach(), mdist::quant::fake_quant(c.x, c.amax, c.format)));
      y.backward(grad_out);
      const at::Tensor expected = backward == mdist::quant::Backward::clipped
                                      ? at::where(inside, grad_out, at::zeros_like(grad_out))
                                      : grad_out;
      EXPECT_TRUE(same(x.grad(), expected));
    }
  }
}

}  // namespace
