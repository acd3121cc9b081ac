// mdist::quant's FP8 KV cache (`--kv-cache fp8`, modelopt 0.47's FP8_KV_CFG) against modelopt
// (fixtures from make_kv_fixtures.py): each model preset with FP8_KV_CFG merged as hf_ptq
// merges it; which quantizers are enabled, every amax (k/v included) exactly (SmoothQuant's
// 1e-6), the quantized loss within 1e-6, the export byte for byte, the export read back (the
// KV scales applied, in the generate cache path too), and the refusals. One process.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <iostream>
#include <numeric>
#include <string>
#include <tuple>

#include "mdist/error.h"
#include "mdist/hf/kv_cache.h"
#include "mdist/hf/pretrained.h"
#include "mdist/quant/export.h"
#include "mdist/quant/kv_cache.h"
#include "mdist/quant/quantize.h"
#include "mdist/quant/readback.h"
#include "tests/quant/ptq_fixture.h"

namespace {

using mdist::quant::QuantConfig;
using mdist::quant::QuantizerRole;
using mdist::quant::testing::fixture_dir;
using mdist::quant::testing::forward_batches;
using mdist::quant::testing::PtqFixture;
using mdist::quant::testing::relative;
using ::testing::HasSubstr;

QuantConfig with_kv(const std::string& preset) {
  QuantConfig config = QuantConfig::preset(preset);
  mdist::quant::add_kv_cache_rules(config, "fp8");
  return config;
}

std::vector<int64_t> all_batches(const PtqFixture& fixture) {
  std::vector<int64_t> all(static_cast<std::size_t>(fixture.batches()));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

class PtqKv : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

// Every quantizer modelopt created (attention q/k/v/p_bmm included): its enabled flag from our
// rules; the k and v ones are enabled, q and p not.
TEST_P(PtqKv, ConfigEnablesWhatModeloptEnables) {
  const auto& [arch, preset] = GetParam();
  const PtqFixture expected(arch, "expected_kv.safetensors");
  const std::string name = preset + "_kv";
  const auto names = expected.list(name + ".quantizers");
  const auto parents = expected.list(name + ".parents");
  const at::Tensor enabled = expected.tensor(name + ".enabled");
  ASSERT_EQ(static_cast<int64_t>(names.size()), enabled.numel());
  const QuantConfig config = with_kv(preset);
  int64_t kv = 0;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const bool weight = names[i].ends_with(".weight_quantizer");
    const auto resolved =
        config.resolve(names[i], parents[i], weight ? QuantizerRole::weight : QuantizerRole::input);
    const bool modelopt = enabled[static_cast<int64_t>(i)].item<int64_t>() == 1;
    EXPECT_EQ(resolved.enabled, modelopt) << names[i];
    if (names[i].ends_with("k_bmm_quantizer") || names[i].ends_with("v_bmm_quantizer")) {
      EXPECT_TRUE(modelopt) << names[i];
      kv += 1;
    }
  }
  EXPECT_EQ(kv, 4);  // 2 layers x k, v
}

// quantize() with the KV rules: every amax as modelopt's (k_bmm / v_bmm included), the loss
// within 1e-6, and different from the same preset's loss without KV quantization.
TEST_P(PtqKv, AmaxAndLossEqualModelopt) {
  const auto& [arch, preset] = GetParam();
  const PtqFixture fixture(arch);
  const PtqFixture expected(arch, "expected_kv.safetensors");
  const std::string name = preset + "_kv";
  mdist::hf::CausalLM model = mdist::hf::load_pretrained(fixture_dir(arch));
  model->eval();
  auto quantizers = mdist::quant::quantize(model, with_kv(preset),
                                           forward_batches(fixture, all_batches(fixture)));
  const auto want = expected.amax(name);
  const auto got = quantizers->amax_state_dict();
  ASSERT_EQ(got.size(), want.size());
  int64_t kv = 0;
  for (const auto& [key, amax] : want) {
    ASSERT_TRUE(got.contains(key)) << key;
    if (preset == "int8_sq" && key.find("_bmm_quantizer") == std::string::npos) {
      EXPECT_TRUE(mdist::quant::testing::close_values(got.at(key), amax, 1e-6)) << key;
    } else {
      EXPECT_TRUE(mdist::quant::testing::same_values(got.at(key), amax)) << key;
    }
    kv += key.find("_bmm_quantizer") != std::string::npos ? 1 : 0;
  }
  EXPECT_EQ(kv, 4);
  const at::Tensor ids = fixture.eval_ids();
  const double loss = model->loss(model->forward(ids), ids).item<double>();
  const double modelopt = expected.tensor(name + ".loss").item<double>();
  EXPECT_LT(relative(loss, modelopt), 1e-6) << loss << " vs modelopt " << modelopt;
  std::cout << arch << " " << name << ": loss " << loss << ", modelopt " << modelopt
            << ", relative difference " << relative(loss, modelopt) << std::endl;
  // The KV fake quant changed the loss (modelopt's without it is the preset's fixture loss).
  EXPECT_GT(relative(loss, fixture.tensor(preset + ".loss").item<double>()), 1e-6);
}

TEST_P(PtqKv, ExportEqualsModeloptsByteForByte) {
  const auto& [arch, preset] = GetParam();
  const PtqFixture fixture(arch);
  mdist::hf::CausalLM model = mdist::hf::load_pretrained(fixture_dir(arch));
  const auto quantizers = mdist::quant::quantize(model, with_kv(preset),
                                                 forward_batches(fixture, all_batches(fixture)));
  const auto out = std::filesystem::path(::testing::TempDir()) / ("ptq_kv_export_" + arch + preset);
  std::filesystem::remove_all(out);
  mdist::quant::export_hf_checkpoint(model, *quantizers, out);
  mdist::quant::testing::expect_export_equals_modelopt(out, arch, preset + "_kv");
}

INSTANTIATE_TEST_SUITE_P(Models, PtqKv,
                         ::testing::Combine(::testing::Values("llama", "qwen3"),
                                            ::testing::Values("fp8", "int8", "int8_sq")),
                         [](const auto& test_info) {
                           return std::get<0>(test_info.param) + "_" + std::get<1>(test_info.param);
                         });

// modelopt's export read back: k/v quantizers with amax = k_scale / v_scale x 448; the loss
// equals the fake-quant loss within the export's rounding; the KV cache path (prefill, then one
// token at a time) gives the full forward's logits, and without the KV quantizers it does not.
TEST(PtqKvReadback, AppliesTheKvScalesInForwardAndInTheCache) {
  for (const std::string arch : {"llama", "qwen3"}) {
    const PtqFixture fixture(arch);
    const PtqFixture expected(arch, "expected_kv.safetensors");
    const auto dir = fixture_dir(arch) / "export_fp8_kv";
    mdist::hf::CausalLM model = mdist::hf::load_pretrained(dir);
    model->eval();
    auto quantizers = mdist::quant::apply_checkpoint_quantization(model, dir);
    ASSERT_TRUE(quantizers);
    ASSERT_EQ(quantizers->attentions().size(), 2u);
    const mdist::hf::SafetensorsFile stored(dir / "model.safetensors");
    for (const auto& a : quantizers->attentions()) {
      ASSERT_TRUE(a->k_bmm_quantizer->has_amax()) << a->name;
      EXPECT_EQ(a->k_bmm_quantizer->amax().item<float>(),
                stored.tensor(a->name + ".k_proj.k_scale").item<float>() * 448.0f);
      EXPECT_EQ(a->v_bmm_quantizer->amax().item<float>(),
                stored.tensor(a->name + ".v_proj.v_scale").item<float>() * 448.0f);
    }
    const torch::NoGradGuard no_grad;
    const at::Tensor ids = fixture.eval_ids();
    const double loss = model->loss(model->forward(ids), ids).item<double>();
    const double fake_quant = expected.tensor("fp8_kv.loss").item<double>();
    std::cout << arch << " fp8_kv export read back: loss " << loss << ", fake quant " << fake_quant
              << ", relative " << relative(loss, fake_quant) << std::endl;
    EXPECT_LT(relative(loss, fake_quant), 1e-6);

    const auto cached_logits = [&] {
      mdist::hf::KvCache cache(model->config.num_hidden_layers);
      const int64_t time = ids.size(1);
      std::vector<at::Tensor> steps{model->forward(ids.narrow(1, 0, time / 2), {}, {}, &cache)};
      for (int64_t t = time / 2; t < time; ++t) {
        steps.push_back(model->forward(ids.narrow(1, t, 1), {}, {}, &cache));
      }
      return at::cat(steps, 1);
    };
    const at::Tensor full = model->forward(ids);
    const at::Tensor cached = cached_logits();
    EXPECT_TRUE(at::allclose(cached, full, 1e-5, 1e-5))
        << (cached - full).abs().max().item<double>();
    // Without the KV quantizers the cached logits move: the cache path was quantized.
    for (const auto& a : quantizers->attentions()) {
      a->k_bmm_quantizer->set_mode(mdist::quant::TensorQuantizerImpl::Mode::disabled);
      a->v_bmm_quantizer->set_mode(mdist::quant::TensorQuantizerImpl::Mode::disabled);
    }
    EXPECT_GT((cached_logits() - cached).abs().max().item<double>(), 1e-4);
  }
}

// Phi-3's attention has one fused qkv_proj: no k_proj / v_proj to name the scales after.
TEST(PtqKvRefusals, FusedQkvAttentionAndUnknownFormat) {
  const auto config = mdist::hf::LlamaConfig::from_json(
      R"({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64,
          "pad_token_id": 0})");
  ASSERT_TRUE(config.fused_projections);
  mdist::hf::CausalLM phi3(config);
  try {
    mdist::quant::quantize(phi3, with_kv("fp8"), {});
    FAIL() << "no exception";
  } catch (const mdist::InputError& e) {
    EXPECT_THAT(e.what(), HasSubstr("model.layers.0.self_attn has one fused qkv_proj"));
  }
  // Without the KV rules the same model quantizes.
  EXPECT_NO_THROW(mdist::quant::quantize(phi3, QuantConfig::preset("fp8"), {}));
  QuantConfig config8 = QuantConfig::preset("fp8");
  try {
    mdist::quant::add_kv_cache_rules(config8, "int8");
    FAIL() << "no exception";
  } catch (const mdist::InputError& e) {
    EXPECT_THAT(e.what(), HasSubstr("unknown KV-cache format 'int8'"));
  }
}

}  // namespace
