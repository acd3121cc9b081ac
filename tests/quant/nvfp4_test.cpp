// NVFP4 (NVFP4_DEFAULT_CFG) beyond what ptq_test checks for every preset (amax, fake-quant loss
// and export against modelopt): the export's packed weights read back, the loss of the export
// read back as a quantized model (mdist's and modelopt's), and the block-size refusal.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include "mdist/error.h"
#include "mdist/hf/pretrained.h"
#include "mdist/hf/quantized_checkpoint.h"
#include "mdist/hf/safetensors.h"
#include "mdist/quant/block_check.h"
#include "mdist/quant/export.h"
#include "mdist/quant/quantize.h"
#include "mdist/quant/readback.h"
#include "tests/quant/ptq_fixture.h"

namespace {

using mdist::quant::QuantConfig;
using mdist::quant::testing::fixture_dir;
using mdist::quant::testing::forward_batches;
using mdist::quant::testing::PtqFixture;
using mdist::quant::testing::relative;
using ::testing::HasSubstr;

struct Quantized {
  mdist::hf::CausalLM model;
  std::unique_ptr<mdist::quant::ModelQuantizers> quantizers;
};

Quantized quantize_fixture(const std::string& arch) {
  const PtqFixture fixture(arch);
  Quantized q{mdist::hf::load_pretrained(fixture_dir(arch)), nullptr};
  q.model->eval();
  std::vector<int64_t> all(static_cast<std::size_t>(fixture.batches()));
  std::iota(all.begin(), all.end(), 0);
  q.quantizers =
      mdist::quant::quantize(q.model, QuantConfig::preset("nvfp4"), forward_batches(fixture, all));
  return q;
}

std::filesystem::path export_of(const std::string& arch, Quantized& q) {
  const auto out = std::filesystem::path(::testing::TempDir()) / ("nvfp4_export_" + arch);
  std::filesystem::remove_all(out);
  mdist::quant::export_hf_checkpoint(q.model, *q.quantizers, out);
  return out;
}

bool fused(const std::string& linear) {
  for (const char* leaf : {".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj"}) {
    if (linear.ends_with(leaf)) return true;
  }
  return false;
}

class Nvfp4 : public ::testing::TestWithParam<std::string> {};

// The export's packed weights, dequantized (E2M1 x weight_scale x weight_scale_2), are the fake
// quant's weights exactly where the layer keeps its own global amax (o_proj, down_proj); q/k/v
// and gate/up are exported under their group's largest weight amax (modelopt's fused-layer
// rule), so there some block scales, and then codes, differ: counted and reported.
TEST_P(Nvfp4, PackedWeightsDequantizeToTheFakeQuantWeights) {
  const std::string arch = GetParam();
  Quantized q = quantize_fixture(arch);
  const auto dir = export_of(arch, q);
  const mdist::hf::SafetensorsCheckpoint checkpoint(dir);
  const torch::NoGradGuard no_grad;
  int64_t fused_differing = 0, fused_total = 0;
  for (const auto& linear : q.quantizers->linears()) {
    if (!linear->weight_quantizer->is_enabled()) continue;  // lm_head
    const std::string name = linear->name + ".weight";
    ASSERT_TRUE(mdist::hf::detail::is_nvfp4_weight(checkpoint, name)) << name;
    const at::Tensor read = mdist::hf::detail::dequantized_rows(checkpoint, name, 0, -1);
    const at::Tensor fake = linear->weight_quantizer(linear->linear->weight).to(at::kFloat);
    ASSERT_EQ(read.sizes(), fake.sizes()) << name;
    if (!fused(linear->name)) {
      EXPECT_TRUE(at::equal(read, fake)) << name << ": " << (read != fake).sum().item<int64_t>()
                                         << " of " << read.numel() << " differ";
      continue;
    }
    fused_differing += (read != fake).sum().item<int64_t>();
    fused_total += read.numel();
  }
  std::cout << "[ measured ] " << arch << " nvfp4: " << fused_differing << " of " << fused_total
            << " q/k/v and gate/up weights differ from the fake quant's (group weight_scale_2)"
            << std::endl;
  // A row-blocked read (as the rank-by-rank loader reads) is the same rows of the whole.
  const std::string down = "model.layers.1.mlp.down_proj.weight";
  EXPECT_TRUE(
      at::equal(mdist::hf::detail::dequantized_rows(checkpoint, down, 3, 5),
                mdist::hf::detail::dequantized_rows(checkpoint, down, 0, -1).narrow(0, 3, 5)));
}

// The export read back (load_pretrained + apply_checkpoint_quantization: dequantized weights,
// inputs fake-quantized under input_scale's global amax): the same loss from mdist's export and
// from modelopt's (byte-equal files), and that loss is modelopt's fake-quantized model's once its
// q/k/v and gate/up share their group's largest amax as the export makes them
// (`nvfp4.export_loss`, 1e-6). Its gap to the fake-quant loss is that sharing; reported.
TEST_P(Nvfp4, ExportReadBackGivesTheQuantizedLoss) {
  const std::string arch = GetParam();
  const PtqFixture fixture(arch);
  const at::Tensor ids = fixture.eval_ids();
  Quantized q = quantize_fixture(arch);
  const torch::NoGradGuard no_grad;
  const double fake = q.model->loss(q.model->forward(ids), ids).item<double>();
  const double plain = fixture.tensor("loss").item<double>();
  const auto read_back = [&](const std::filesystem::path& dir) {
    mdist::hf::CausalLM model = mdist::hf::load_pretrained(dir);
    model->eval();
    const auto quantizers = mdist::quant::apply_checkpoint_quantization(model, dir);
    EXPECT_NE(quantizers, nullptr);
    return model->loss(model->forward(ids), ids).item<double>();
  };
  const double mine = read_back(export_of(arch, q));
  const double theirs = read_back(fixture_dir(arch) / "export_nvfp4");
  EXPECT_EQ(mine, theirs);
  std::cout << "[ measured ] " << arch << " nvfp4: eval of the export " << mine
            << ", fake-quant loss " << fake << ", unquantized " << plain << ", gap "
            << relative(mine, fake) << " relative" << std::endl;
  const double shared = fixture.tensor("nvfp4.export_loss").item<double>();
  EXPECT_LT(relative(mine, shared), 1e-6) << mine << " vs modelopt's " << shared;
}

INSTANTIATE_TEST_SUITE_P(Models, Nvfp4, ::testing::Values("llama", "qwen3"));

// A Linear whose in_features 16 does not divide: named with its sizes, before calibrating.
TEST(Nvfp4Blocks, InFeaturesNotAMultipleOf16AreRefused) {
  auto config = mdist::hf::LlamaConfig::from_file((fixture_dir("qwen3") / "config.json").string());
  config.intermediate_size = 40;
  mdist::hf::CausalLM model(config, c10::kMeta);
  const auto problem = mdist::quant::block_size_problem(model, QuantConfig::preset("nvfp4"));
  ASSERT_TRUE(problem.has_value());
  EXPECT_THAT(*problem, HasSubstr("model.layers.0.mlp.down_proj has in_features 40"));
  EXPECT_THAT(*problem, HasSubstr("blocks of 16"));
  // Formats without blocks take any size.
  EXPECT_FALSE(mdist::quant::block_size_problem(model, QuantConfig::preset("fp8")).has_value());
  EXPECT_FALSE(mdist::quant::block_size_problem(model, QuantConfig::preset("int8")).has_value());
  // Under tensor parallelism the row-parallel shards count: o_proj's 32 inputs are 16 per rank
  // on 2 ranks (whole blocks), 8 on 4.
  auto even_config = config;
  even_config.intermediate_size = 64;
  mdist::hf::CausalLM even(even_config, c10::kMeta);
  EXPECT_FALSE(mdist::quant::block_size_problem(even, QuantConfig::preset("nvfp4"), 2).has_value());
  const auto split = mdist::quant::block_size_problem(even, QuantConfig::preset("nvfp4"), 4);
  ASSERT_TRUE(split.has_value());
  EXPECT_THAT(*split, HasSubstr("model.layers.0.self_attn.o_proj has in_features 8 per "
                                "tensor-parallel rank (32 / 4)"));

  mdist::hf::CausalLM real(config);
  try {
    (void)mdist::quant::quantize(real, QuantConfig::preset("nvfp4"), nullptr);
    FAIL() << "no exception";
  } catch (const mdist::InputError& e) {
    EXPECT_THAT(e.what(), HasSubstr("model.layers.0.mlp.down_proj has in_features 40"));
  }
}

// A checkpoint labelled NVFP4 whose weights are not packed E2M1 is refused by the loader, never
// read with the wrong arithmetic.
TEST(Nvfp4ReadBack, MislabelledCheckpointIsRefused) {
  const auto copy = std::filesystem::path(::testing::TempDir()) / "nvfp4_mislabelled";
  std::filesystem::remove_all(copy);
  std::filesystem::copy(fixture_dir("llama") / "export_fp8", copy);
  auto config = mdist::quant::testing::read_json(copy / "config.json");
  config["quantization_config"]["quant_algo"] = "NVFP4";
  std::ofstream(copy / "config.json") << config.dump(2);
  try {
    (void)mdist::hf::load_pretrained(copy);
    FAIL() << "no exception";
  } catch (const mdist::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("quant_algo NVFP4 stores its weights as"));
  }
}

}  // namespace
