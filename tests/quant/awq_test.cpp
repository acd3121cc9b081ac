// AWQ-lite (mdist quantize --format int4_awq) against modelopt 0.47's mtq.INT4_AWQ_CFG
// (fixtures from make_awq_fixtures.py): which quantizers are enabled, every block amax and
// pre_quant_scale (1e-6 relative), the quantized loss (1e-6 relative), on tiny Llama (biases,
// tied head) and Qwen3 (GQA, q/k norms) checkpoints whose Linears have whole blocks of 128.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <string>

#include "mdist/error.h"
#include "mdist/hf/pretrained.h"
#include "mdist/hf/safetensors.h"
#include "mdist/quant/export.h"
#include "mdist/quant/quant_config.h"
#include "mdist/quant/quantize.h"
#include "tests/quant/ptq_fixture.h"

namespace {

using mdist::quant::QuantConfig;
using mdist::quant::QuantizerRole;
using mdist::quant::testing::close_values;
using mdist::quant::testing::fixture_dir;
using mdist::quant::testing::forward_batches;
using mdist::quant::testing::PtqFixture;
using mdist::quant::testing::relative;
using ::testing::HasSubstr;

const std::string kPreset = "int4_awq";

std::vector<int64_t> all_batches(const PtqFixture& fixture) {
  std::vector<int64_t> all(static_cast<std::size_t>(fixture.batches()));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

class Awq : public ::testing::TestWithParam<std::string> {};

TEST_P(Awq, ConfigEnablesWhatModeloptEnables) {
  const PtqFixture fixture(GetParam());
  const auto names = fixture.list(kPreset + ".quantizers");
  const auto parents = fixture.list(kPreset + ".parents");
  const at::Tensor enabled = fixture.tensor(kPreset + ".enabled");
  ASSERT_EQ(static_cast<int64_t>(names.size()), enabled.numel());
  const auto config = QuantConfig::preset(kPreset);
  int64_t on = 0;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const bool weight = names[i].ends_with(".weight_quantizer");
    const auto resolved =
        config.resolve(names[i], parents[i], weight ? QuantizerRole::weight : QuantizerRole::input);
    EXPECT_EQ(resolved.enabled, enabled[static_cast<int64_t>(i)].item<int64_t>() == 1) << names[i];
    on += resolved.enabled ? 1 : 0;
    if (resolved.enabled) {
      EXPECT_EQ(resolved.format, mdist::quant::QuantFormat::int4_blocks());
    }
  }
  EXPECT_EQ(on, 14);  // the weights of 7 Linears in 2 layers; no input
}

// Every block amax and pre_quant_scale as modelopt's within 1e-6 relative (the count of
// bit-equal tensors printed), and the quantized loss within 1e-6 relative.
TEST_P(Awq, AmaxPreQuantScaleAndLossEqualModelopt) {
  const std::string arch = GetParam();
  const PtqFixture fixture(arch);
  mdist::hf::CausalLM model = mdist::hf::load_pretrained(fixture_dir(arch));
  model->eval();
  const at::Tensor ids = fixture.eval_ids();
  const double plain = model->loss(model->forward(ids), ids).item<double>();
  EXPECT_LT(relative(plain, fixture.tensor("loss").item<double>()), 1e-6);

  auto quantizers = mdist::quant::quantize(model, QuantConfig::preset(kPreset),
                                           forward_batches(fixture, all_batches(fixture)));
  const auto expected = fixture.amax(kPreset);
  const auto actual = quantizers->amax_state_dict();
  ASSERT_EQ(actual.size(), expected.size());
  ASSERT_EQ(expected.size(), 14u);
  int64_t equal = 0;
  for (const auto& [name, amax] : expected) {
    ASSERT_TRUE(actual.contains(name)) << name;
    EXPECT_TRUE(close_values(actual.at(name), amax, 1e-6)) << name;
    equal += at::equal(actual.at(name).to(at::kFloat), amax) ? 1 : 0;
  }
  const auto expected_scales = fixture.pre_quant_scales(kPreset);
  ASSERT_EQ(expected_scales.size(), 14u);  // AWQ's 1 / s on every input, and modelopt's 1s
  const auto by_name = quantizers->quantizers();
  int64_t scales_checked = 0, not_ones = 0;
  for (const auto& [name, scale] : expected_scales) {
    // modelopt also leaves the weight quantizer an (unused, all-ones) buffer.
    if (name.find(".input_quantizer.") == std::string::npos) continue;
    ++scales_checked;
    const std::string linear = name.substr(0, name.find(".input_quantizer."));
    const auto& quantizer = by_name.at(linear + ".input_quantizer");
    ASSERT_TRUE(quantizer->pre_quant_scale().defined()) << name;
    EXPECT_EQ(quantizer->pre_quant_scale().scalar_type(), scale.scalar_type()) << name;
    EXPECT_TRUE(close_values(quantizer->pre_quant_scale(), scale, 1e-6)) << name;
    equal += at::equal(quantizer->pre_quant_scale(), scale) ? 1 : 0;
    // The search chose a real scale (alpha 0 with a flat weight statistic would give ones).
    not_ones += at::allclose(scale, at::ones_like(scale)) ? 0 : 1;
  }
  EXPECT_GT(scales_checked, 0);
  EXPECT_GT(not_ones, 0);
  std::cout << arch << " int4_awq: " << equal << " of " << expected.size() + scales_checked
            << " amax / pre_quant_scale tensors bit-equal to modelopt's" << std::endl;
  const double quantized = model->loss(model->forward(ids), ids).item<double>();
  const double modelopt = fixture.tensor(kPreset + ".loss").item<double>();
  EXPECT_LT(relative(quantized, modelopt), 1e-6) << quantized << " vs modelopt " << modelopt;
  std::cout << arch << " int4_awq: loss " << quantized << ", modelopt " << modelopt
            << ", relative difference " << relative(quantized, modelopt) << std::endl;
  EXPECT_GT(relative(quantized, plain), 1e-4);  // the fake quant really ran

  quantizers.reset();
  EXPECT_EQ(model->loss(model->forward(ids), ids).item<double>(), plain);
}

// modelopt's export_hf_checkpoint of the same quantized model (W4A16_AWQ): every tensor byte
// for byte (packed int4 weights, block scales, the norms with q/k/v's and gate/up's mean
// pre_quant_scale folded in, o_proj's and down_proj's pre_quant_scale), hf_quant_config.json
// and config.json's quantization_config equal but for the producer's version.
TEST_P(Awq, ExportEqualsModeloptsByteForByte) {
  const std::string arch = GetParam();
  const PtqFixture fixture(arch);
  mdist::hf::CausalLM model = mdist::hf::load_pretrained(fixture_dir(arch));
  const auto quantizers = mdist::quant::quantize(model, QuantConfig::preset(kPreset),
                                                 forward_batches(fixture, all_batches(fixture)));
  const auto out = std::filesystem::path(::testing::TempDir()) / ("awq_export_" + arch);
  std::filesystem::remove_all(out);
  mdist::quant::export_hf_checkpoint(model, *quantizers, out);
  mdist::quant::testing::expect_export_equals_modelopt(out, arch, kPreset);
}

INSTANTIATE_TEST_SUITE_P(Models, Awq, ::testing::Values("awq_llama", "awq_qwen3"));

// The bf16 Qwen3: AWQ's statistics come from bf16 activations, which libtorch and PyTorch
// compute differently in the last bit after the first attention (as for SmoothQuant), so the
// export is compared within bounds, the counts printed: pre_quant_scales and block scales within
// a few bf16 steps, at most 2 % of the packed int4 bytes different, the loss within 1e-2.
TEST(AwqBf16, ExportWithinBf16ActivationSteps) {
  const PtqFixture fixture("awq_qwen3_bf16");
  const auto dir = fixture_dir("awq_qwen3_bf16");
  mdist::hf::CausalLM model = mdist::hf::load_pretrained(dir);
  model->to(at::kBFloat16);
  const auto quantizers = mdist::quant::quantize(model, QuantConfig::preset(kPreset),
                                                 forward_batches(fixture, all_batches(fixture)));
  const at::Tensor ids = fixture.eval_ids();
  const double loss = model->loss(model->forward(ids), ids).item<double>();
  const double modelopt = fixture.tensor(kPreset + ".loss").item<double>();
  EXPECT_LT(relative(loss, modelopt), 1e-2);
  const auto out = std::filesystem::path(::testing::TempDir()) / "awq_export_bf16";
  std::filesystem::remove_all(out);
  mdist::quant::export_hf_checkpoint(model, *quantizers, out);
  const mdist::hf::SafetensorsFile expected(dir / "export_int4_awq" / "model.safetensors");
  const mdist::hf::SafetensorsFile actual(out / "model.safetensors");
  ASSERT_EQ(actual.names(), expected.names());
  int64_t bytes = 0, moved = 0, equal = 0;
  double worst = 0.0;
  for (const auto& name : expected.names()) {
    const at::Tensor a = actual.tensor(name), e = expected.tensor(name);
    ASSERT_EQ(a.scalar_type(), e.scalar_type()) << name;
    ASSERT_EQ(a.sizes(), e.sizes()) << name;
    equal += mdist::quant::testing::same_bytes(a, e) ? 1 : 0;
    if (a.scalar_type() == at::kByte) {
      bytes += a.numel();
      moved += (a != e).sum().item<int64_t>();
      continue;
    }
    const double rel = ((a.to(at::kDouble) - e.to(at::kDouble)).abs() / e.to(at::kDouble).abs())
                           .max()
                           .item<double>();
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 10.0 / 256) << name;
  }
  EXPECT_LE(static_cast<double>(moved), 0.02 * static_cast<double>(bytes));
  std::cout << "qwen3 bf16 int4_awq: loss " << loss << ", modelopt " << modelopt << "; " << equal
            << " of " << expected.names().size() << " tensors byte-equal; packed bytes differing "
            << moved << " of " << bytes << "; largest other difference " << worst << " relative"
            << std::endl;
}

// A Linear whose in_features the block of 128 does not divide (the ptq fixtures: hidden 32) is
// an InputError naming it and the sizes, before anything is calibrated.
TEST(AwqInput, InFeaturesNotAMultipleOfTheBlockIsRefused) {
  const PtqFixture fixture("qwen3");
  mdist::hf::CausalLM model = mdist::hf::load_pretrained(fixture_dir("qwen3"));
  try {
    (void)mdist::quant::quantize(model, QuantConfig::preset(kPreset),
                                 forward_batches(fixture, {0}));
    FAIL() << "no exception";
  } catch (const mdist::InputError& e) {
    EXPECT_THAT(e.what(), HasSubstr("model.layers.0.self_attn.q_proj has in_features 32, which "
                                    "int4 static blocks of 128 does not divide into whole "
                                    "blocks of 128"));
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
  }
}

}  // namespace
