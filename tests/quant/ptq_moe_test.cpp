// mdist::quant::quantize on a mixture of experts against modelopt 0.47 + transformers 5.24
// (fixtures from make_ptq_moe_fixtures.py: a tiny Qwen3-MoE whose experts transformers 5 fuses
// and modelopt quantizes as one module per block, _QuantFusedExperts): every amax under
// modelopt's fused names, the quantized loss (1e-6 relative) and the export byte for byte, for
// fp8, int8, int8_sq (SmoothQuant on the attention only) and nvfp4; one process.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include "mdist/hf/pretrained.h"
#include "mdist/quant/export.h"
#include "mdist/quant/quant_config.h"
#include "mdist/quant/quantize.h"
#include "tests/quant/ptq_fixture.h"

namespace {

using mdist::quant::QuantConfig;
using mdist::quant::testing::close_values;
using mdist::quant::testing::fixture_dir;
using mdist::quant::testing::forward_batches;
using mdist::quant::testing::PtqFixture;
using mdist::quant::testing::relative;
using mdist::quant::testing::same_values;
using mdist::quant::testing::with_fused_expert_names;

constexpr const char* kArch = "qwen3_moe";

class PtqMoe : public ::testing::TestWithParam<std::string> {
 protected:
  // The fixture model quantized with the fixture's calibration batches.
  std::unique_ptr<mdist::quant::ModelQuantizers> quantize(mdist::hf::CausalLM& model) {
    std::vector<int64_t> all(static_cast<std::size_t>(fixture_.batches()));
    std::iota(all.begin(), all.end(), 0);
    return mdist::quant::quantize(model, QuantConfig::preset(GetParam()),
                                  forward_batches(fixture_, all));
  }
  const PtqFixture fixture_{kArch};
};

// Every amax modelopt's state dict holds (the shared expert input amaxes, the per-expert
// weight amaxes, the attention's): max calibration bit for bit; under SmoothQuant 1e-6
// relative (the experts see the smoothed attention's outputs), and the attention's
// pre_quant_scales too, the experts having none. The quantized loss within 1e-6.
TEST_P(PtqMoe, AmaxAndLossEqualModelopt) {
  const std::string preset = GetParam();
  mdist::hf::CausalLM model = mdist::hf::load_pretrained(fixture_dir(kArch));
  model->eval();
  const at::Tensor ids = fixture_.eval_ids();
  const torch::NoGradGuard no_grad;
  const double plain = model->loss(model->forward(ids), ids).item<double>();
  EXPECT_LT(relative(plain, fixture_.tensor("loss").item<double>()), 1e-6);

  auto quantizers = quantize(model);
  std::vector<std::string> problems;
  const auto actual = with_fused_expert_names(quantizers->amax_state_dict(), problems);
  EXPECT_THAT(problems, ::testing::IsEmpty());
  const auto expected = fixture_.amax(preset);
  ASSERT_EQ(actual.size(), expected.size());
  const bool smoothquant = preset == "int8_sq";
  for (const auto& [name, amax] : expected) {
    ASSERT_TRUE(actual.contains(name)) << name;
    if (smoothquant) {
      EXPECT_TRUE(close_values(actual.at(name), amax, 1e-6)) << name;
    } else {
      EXPECT_TRUE(same_values(actual.at(name), amax)) << name;
    }
  }
  const auto scales = fixture_.pre_quant_scales(preset);
  EXPECT_EQ(scales.empty(), !smoothquant);
  const auto by_name = quantizers->quantizers();
  int with_scale = 0;
  for (const auto& [name, quantizer] : by_name) {
    if (!quantizer->pre_quant_scale().defined()) continue;
    ++with_scale;
    const std::string key = name + "._pre_quant_scale";
    ASSERT_TRUE(scales.contains(key)) << name << " has a pre_quant_scale modelopt's has not";
    EXPECT_TRUE(close_values(quantizer->pre_quant_scale(), scales.at(key), 1e-6)) << name;
  }
  EXPECT_EQ(with_scale, static_cast<int>(scales.size()));

  const double quantized = model->loss(model->forward(ids), ids).item<double>();
  const double modelopt = fixture_.tensor(preset + ".loss").item<double>();
  EXPECT_LT(relative(quantized, modelopt), 1e-6) << quantized << " vs modelopt " << modelopt;
  std::cout << kArch << " " << preset << ": loss " << quantized << ", modelopt " << modelopt
            << ", relative difference " << relative(quantized, modelopt) << std::endl;
  EXPECT_GT(relative(quantized, plain), 1e-4);  // the fake quant really ran
  quantizers.reset();
  EXPECT_EQ(model->loss(model->forward(ids), ids).item<double>(), plain);
}

// modelopt's export_hf_checkpoint of the same quantized model, which splits the fused experts
// into per-expert gate_proj / up_proj / down_proj: every tensor byte for byte, the JSON equal.
TEST_P(PtqMoe, ExportEqualsModeloptsByteForByte) {
  const std::string preset = GetParam();
  mdist::hf::CausalLM model = mdist::hf::load_pretrained(fixture_dir(kArch));
  model->eval();
  const auto quantizers = quantize(model);
  const auto out = std::filesystem::path(::testing::TempDir()) / ("ptq_moe_export_" + preset);
  std::filesystem::remove_all(out);
  mdist::quant::export_hf_checkpoint(model, *quantizers, out);
  mdist::quant::testing::expect_export_equals_modelopt(out, kArch, preset);
}

INSTANTIATE_TEST_SUITE_P(Presets, PtqMoe, ::testing::Values("fp8", "int8", "int8_sq", "nvfp4"));

}  // namespace
