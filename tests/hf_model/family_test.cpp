// Phi-3 (Phi3ForCausalLM: fused qkv_proj and gate_up_proj, longrope with the pretraining length
// at the top level, partial rotary, a window on every layer) and OLMo 2 (Olmo2ForCausalLM: norms
// after each sub-layer, q/k norms over the whole projections, fp32 norm weights and rotation)
// against transformers 5.24: the fixtures make_family_fixtures.py writes (24 tokens, beyond
// original_max_position_embeddings 16 and the window of 5), and the configs' reading,
// refusing and writing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <string>

#include "mdist/error.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/hf/config.h"
#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/hf/generate.h"
#include "mdist/hf/rotary.h"
#include "mdist/hf/tensor_parallel.h"
#include "tests/hf_model/fixture_reader.h"
#include "tests/hf_model/parity.h"

namespace {

using mdist::hf::CausalLM;
using mdist::hf::ConfigError;
using mdist::hf::LlamaConfig;
using mdist::test::fixture_dir;
using mdist::test::is_weight;
using mdist::test::loaded;
using mdist::test::read_fixture;
using mdist::test::read_text;
using mdist::test::real_error;
using ::testing::HasSubstr;

LlamaConfig config_of(const std::string& name) {
  return LlamaConfig::from_file(fixture_dir(name) + "/config.json");
}

// Each parameter's gradient norm against transformers', relative; parameters in name order.
double worst_gradient_error(CausalLM& model, const at::Tensor& norms) {
  auto params = model->named_parameters().pairs();
  std::sort(params.begin(), params.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  EXPECT_EQ(norms.numel(), static_cast<int64_t>(params.size()));
  double worst = 0;
  for (std::size_t i = 0; i < params.size() && i < static_cast<std::size_t>(norms.numel()); ++i) {
    const double expected = norms[static_cast<int64_t>(i)].item<double>();
    EXPECT_TRUE(params[i].second.grad().defined()) << params[i].first;
    if (!params[i].second.grad().defined()) continue;
    EXPECT_GT(expected, 0) << params[i].first;
    const double actual = params[i].second.grad().to(at::kFloat).norm().item<double>();
    worst = std::max(worst, std::abs(actual - expected) / expected);
  }
  return worst;
}

class FamilyParity : public ::testing::TestWithParam<std::string> {};

TEST_P(FamilyParity, ParameterNamesAreTheCheckpointKeys) {
  const auto fixture = read_fixture(fixture_dir(GetParam()));
  const CausalLM model(config_of(GetParam()));
  std::set<std::string> params, keys;
  for (const auto& item : model->named_parameters()) params.insert(item.key());
  for (const auto& [name, t] : fixture) {
    if (is_weight(name)) keys.insert(name);
  }
  EXPECT_EQ(params, keys);
}

// fsdp2_wrap's units: each decoder layer (then the root).
TEST_P(FamilyParity, Fsdp2WrapFindsTheDecoderLayers) {
  CausalLM model(config_of(GetParam()));
  const auto layers = mdist::get_decoder_layers(*model);
  ASSERT_EQ(layers.size(), 2u);
  EXPECT_EQ(layers[0].get(), model->model->decoder_layers[0].ptr().get());
  EXPECT_EQ(layers[1].get(), model->model->decoder_layers[1].ptr().get());
}

TEST_P(FamilyParity, LogitsLossAndGradientsMatchTransformersInFloat32) {
  const auto fixture = read_fixture(fixture_dir(GetParam()));
  CausalLM model = loaded(config_of(GetParam()), fixture);
  const at::Tensor logits = model->forward(fixture.at("input_ids"), fixture.at("attention_mask"));
  const double logit_error = real_error(logits, fixture);
  EXPECT_LT(logit_error, 1e-5) << GetParam();
  EXPECT_GT(fixture.at("logits").abs().max().item<double>(), 1.0);
  const at::Tensor loss = CausalLM::Impl::loss(logits, fixture.at("labels"));
  const double loss_error = std::abs(loss.item<double>() - fixture.at("loss").item<double>());
  EXPECT_LT(loss_error, 1e-5) << GetParam();
  loss.backward();
  const double grad_error = worst_gradient_error(model, fixture.at("grad_norms"));
  EXPECT_LT(grad_error, 1e-5) << GetParam();

  // Later forwards in transformers' order (phi3: 20 tokens on the long factors, 12 on the
  // short ones again).
  double followup_error = 0;
  for (const int64_t length : {20, 12}) {
    const std::string key = "logits_" + std::to_string(length);
    if (!fixture.contains(key)) continue;
    const at::NoGradGuard no_grad;
    const at::Tensor later = model->forward(fixture.at("input_ids").slice(1, 0, length));
    followup_error = std::max(followup_error, (later - fixture.at(key)).abs().max().item<double>());
  }
  EXPECT_LT(followup_error, 1e-5) << GetParam();
  std::printf(
      "[%s] max |logit error| %.3g, |loss error| %.3g, worst relative grad-norm error %.3g, "
      "later forwards %.3g\n",
      GetParam().c_str(), logit_error, loss_error, grad_error, followup_error);
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyParity,
                         ::testing::Values("phi3", "olmo2", "gemma2", "gemma3"));

// The bf16 fixtures: transformers ran the model in bf16 (sdpa). The weights are the same
// (f16-exact, so bf16-exact here too); the difference is bf16 rounding of kernels that sum in
// another order: transformers' own eager and sdpa attention differ by 0.13 on these logits
// (max 5.4 and 6.8), so the bound is that noise, not 1e-5. Gemma 2's soft-capping makes
// its tiny model sensitive to rounding: transformers' own fp32 run is 0.9 from its bf16 run
// (logits capped at 3); there the bound is half of that distance (which mdist's fp32 model,
// equal to transformers' fp32, measures), so mdist's bf16 run must be much closer to
// transformers' bf16 run than exact fp32 is.
class Bfloat16Parity : public ::testing::TestWithParam<std::string> {};

TEST_P(Bfloat16Parity, LogitsLossAndGradientsMatchTransformers) {
  const std::string name = GetParam();
  const auto fixture = read_fixture(fixture_dir(name));
  CausalLM model = loaded(config_of(name), fixture, at::kBFloat16);
  const at::Tensor logits = model->forward(fixture.at("input_ids"), fixture.at("attention_mask"));
  EXPECT_EQ(logits.scalar_type(), at::kBFloat16);
  const double scale = fixture.at("logits").abs().max().item<double>();
  const double logit_error = real_error(logits, fixture);
  double fp32_distance = 0;
  {
    const at::NoGradGuard no_grad;
    CausalLM fp32 = loaded(config_of(name), fixture);
    fp32_distance =
        real_error(fp32->forward(fixture.at("input_ids"), fixture.at("attention_mask")), fixture);
  }
  EXPECT_LT(logit_error, std::max(0.04 * scale, 0.5 * fp32_distance)) << name;
  const at::Tensor loss = CausalLM::Impl::loss(logits, fixture.at("labels"));
  const double loss_error = std::abs(loss.item<double>() - fixture.at("loss").item<double>());
  EXPECT_LT(loss_error, 0.02) << name;
  loss.backward();
  const double grad_error = worst_gradient_error(model, fixture.at("grad_norms"));
  EXPECT_LT(grad_error, 0.05) << name;
  std::printf(
      "[%s bf16] max |logit error| %.3g (max |logit| %.3g; fp32 model %.3g), |loss error| "
      "%.3g, worst relative grad-norm error %.3g\n",
      name.c_str(), logit_error, scale, fp32_distance, loss_error, grad_error);
}

INSTANTIATE_TEST_SUITE_P(Families, Bfloat16Parity,
                         ::testing::Values("phi3_bf16", "olmo2_bf16", "gemma2_bf16",
                                           "gemma3_bf16"));

// Greedy generation against transformers' model.generate with its cache (generate.json of
// make_generate_fixtures.py). phi3: 7-token prompts and 24 new tokens cross
// original_max_position_embeddings (16), where transformers drops the cache and recomputes on
// the long factors.
TEST_P(FamilyParity, GreedyGenerationEqualsTransformersGenerate) {
  const auto fixture = read_fixture(fixture_dir(GetParam()));
  CausalLM model = loaded(config_of(GetParam()), fixture);
  const auto expected =
      nlohmann::json::parse(read_text(fixture_dir(GetParam()) + "/generate.json"));
  mdist::hf::GenerationOptions options;
  options.max_new_tokens = expected.at("max_new_tokens").get<int64_t>();
  options.eos_token_ids = mdist::hf::eos_token_ids(model->config);
  if (model->config.pad_token_id) options.pad_token_id = *model->config.pad_token_id;
  ASSERT_EQ(expected.at("cases").size(), 4u);
  for (const auto& c : expected.at("cases")) {
    const auto prompts = c.at("prompts").get<std::vector<std::vector<int64_t>>>();
    EXPECT_EQ(mdist::hf::generate(model, prompts, options),
              c.at("outputs").get<std::vector<std::vector<int64_t>>>())
        << GetParam() << " " << prompts.size() << " prompt(s)";
  }
}

TEST(FamilyParity, Phi3RotaryTablesEqualTransformers) {
  const auto fixture = read_fixture(fixture_dir("phi3"));
  mdist::hf::RotaryEmbedding rotary(config_of("phi3"));
  EXPECT_TRUE(torch::equal(rotary.inv_freq(), fixture.at("rope:inv_freq")));
  EXPECT_EQ(static_cast<float>(rotary.attention_scaling()),
            fixture.at("rope:attention_scaling")[0].item<float>());
  (void)rotary.cos_sin(torch::arange(24, torch::kLong).unsqueeze(0), at::kFloat);
  EXPECT_TRUE(torch::equal(rotary.inv_freq(), fixture.at("rope:inv_freq_after")));
}

// Each fixture exercises what it is for: without it, the logits of real tokens move.
TEST(FamilyFixtures, DependOnLongropePartialRotaryAndWindow) {
  const auto error_with = [](const std::string& name, auto&& change) {
    const auto fixture = read_fixture(fixture_dir(name));
    LlamaConfig config = config_of(name);
    change(config);
    CausalLM model = loaded(config, fixture);
    const at::NoGradGuard no_grad;
    return real_error(model->forward(fixture.at("input_ids"), fixture.at("attention_mask")),
                      fixture);
  };
  EXPECT_GT(error_with("phi3", [](LlamaConfig& c) { c.rope_scaling.reset(); }), 1e-2);
  // The top-level pretraining length (16), not max_position_embeddings: the long factors.
  EXPECT_GT(error_with("phi3",
                       [](LlamaConfig& c) {
                         c.rope_scaling->original_max_position_embeddings =
                             c.max_position_embeddings;
                       }),
            1e-2);
  EXPECT_GT(error_with("phi3",
                       [](LlamaConfig& c) {
                         c.partial_rotary_factor = 1.0;
                         c.rope_scaling.reset();
                       }),
            1e-2);
  // phi3_bf16 ran in bf16: in fp32 the logits are within bf16 noise of it (0.16); without the
  // window far from it.
  const double windowed = error_with("phi3_bf16", [](LlamaConfig&) {});
  const double unwindowed =
      error_with("phi3_bf16", [](LlamaConfig& c) { c.sliding_window.reset(); });
  std::printf("[phi3_bf16] in fp32: max |logit error| %.3g with the window, %.3g without\n",
              windowed, unwindowed);
  EXPECT_GT(unwindowed, 4 * windowed);
}

// gemma2: every Gemma 2 feature moves the logits of real tokens (the fixture exercises each).
TEST(FamilyFixtures, Gemma2DependsOnEachOfItsFeatures) {
  const auto fixture = read_fixture(fixture_dir("gemma2"));
  const auto error_with = [&](auto&& change) {
    LlamaConfig config = config_of("gemma2");
    change(config);
    CausalLM model = loaded(config, fixture);
    const at::NoGradGuard no_grad;
    return real_error(model->forward(fixture.at("input_ids"), fixture.at("attention_mask")),
                      fixture);
  };
  EXPECT_LT(error_with([](LlamaConfig&) {}), 1e-5);
  EXPECT_GT(error_with([](LlamaConfig& c) { c.attn_logit_softcapping.reset(); }), 1e-2);
  EXPECT_GT(error_with([](LlamaConfig& c) { c.final_logit_softcapping.reset(); }), 1e-2);
  EXPECT_GT(error_with([](LlamaConfig& c) { c.query_pre_attn_scalar.reset(); }), 1e-2);
  EXPECT_GT(error_with([](LlamaConfig& c) { c.scale_embeddings = false; }), 1e-2);
  EXPECT_GT(error_with([](LlamaConfig& c) { c.layer_types.clear(); }), 1e-2);  // both windowed
  EXPECT_GT(error_with([](LlamaConfig& c) { c.sliding_window.reset(); }), 1e-2);
}

// gemma3: the per-layer-type RoPE (linear scaling and theta 1e6 on the full layer, theta 1e4
// on the sliding one), the q/k norms and the window each move the logits of real tokens.
TEST(FamilyFixtures, Gemma3DependsOnEachOfItsFeatures) {
  const auto fixture = read_fixture(fixture_dir("gemma3"));
  const auto error_with = [&](auto&& change) {
    LlamaConfig config = config_of("gemma3");
    change(config);
    CausalLM model = loaded(config, fixture);
    const at::NoGradGuard no_grad;
    return real_error(model->forward(fixture.at("input_ids"), fixture.at("attention_mask")),
                      fixture);
  };
  EXPECT_LT(error_with([](LlamaConfig&) {}), 1e-5);
  EXPECT_GT(error_with([](LlamaConfig& c) { c.rope_scaling.reset(); }), 1e-2);
  EXPECT_GT(error_with([](LlamaConfig& c) { c.sliding_rope_theta.reset(); }), 1e-2);
  EXPECT_GT(error_with([](LlamaConfig& c) { c.sliding_rope_theta = c.rope_theta; }), 1e-2);
  EXPECT_GT(error_with([](LlamaConfig& c) { c.sliding_window.reset(); }), 1e-2);
  EXPECT_GT(error_with([](LlamaConfig& c) { c.query_pre_attn_scalar.reset(); }), 1e-2);
  // The q/k norms are parameters: a model without them does not load the fixture.
  EXPECT_THROW(error_with([](LlamaConfig& c) { c.qk_norm = false; }), mdist::Error);
}

// --- LlamaConfig for Phi-3, OLMo 2 and Gemma -------------------------------------------------

std::string config_json(const std::string& architecture, const std::string& extra = "") {
  return R"({"architectures": [")" + architecture +
         R"("], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40000)" +
         extra + "}";
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const mdist::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(FamilyConfig, DefaultsAreTheConfigClasses) {
  const LlamaConfig phi3 = LlamaConfig::from_json(config_json("Phi3ForCausalLM"));
  EXPECT_TRUE(phi3.fused_projections);
  EXPECT_FALSE(phi3.post_norms || phi3.qk_norm || phi3.qkv_bias || phi3.o_bias);
  EXPECT_EQ(phi3.max_position_embeddings, 4096);
  EXPECT_EQ(phi3.rms_norm_eps, 1e-5);
  EXPECT_EQ(phi3.pad_token_id, 32000);
  EXPECT_FALSE(phi3.sliding_window.has_value());
  const LlamaConfig olmo2 = LlamaConfig::from_json(config_json("Olmo2ForCausalLM"));
  EXPECT_TRUE(olmo2.post_norms && olmo2.qk_norm && olmo2.qk_norm_full_width &&
              olmo2.fp32_norm_weight_and_rotary);
  EXPECT_FALSE(olmo2.fused_projections || olmo2.qkv_bias);
  EXPECT_EQ(olmo2.max_position_embeddings, 2048);
  EXPECT_EQ(olmo2.pad_token_id, 1);
  EXPECT_TRUE(LlamaConfig::from_json(config_json("Olmo2ForCausalLM", R"(, "attention_bias": true)"))
                  .o_bias);
  // model_type alone names the architecture, as AutoModelForCausalLM.
  EXPECT_EQ(LlamaConfig::from_json(R"({"model_type": "phi3", "hidden_size": 32,
      "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
      "vocab_size": 40000})")
                .architecture,
            "Phi3ForCausalLM");
}

TEST(FamilyConfig, GemmaDefaultsAreTheConfigClasses) {
  const LlamaConfig g2 = LlamaConfig::from_json(config_json("Gemma2ForCausalLM"));
  EXPECT_TRUE(g2.sandwich_norms && g2.norm_unit_offset && g2.scale_embeddings);
  EXPECT_FALSE(g2.qk_norm || g2.post_norms || g2.qkv_bias);
  EXPECT_EQ(g2.hidden_act, "gelu_pytorch_tanh");
  EXPECT_EQ(g2.head_dim, 256);
  EXPECT_EQ(g2.num_key_value_heads, 2);  // given
  EXPECT_EQ(g2.max_position_embeddings, 8192);
  EXPECT_TRUE(g2.tie_word_embeddings);
  EXPECT_EQ(g2.pad_token_id, 0);
  EXPECT_EQ(g2.query_pre_attn_scalar, 256);
  EXPECT_EQ(g2.attn_logit_softcapping, 50.0);
  EXPECT_EQ(g2.final_logit_softcapping, 30.0);
  EXPECT_EQ(g2.sliding_window, 4096);
  EXPECT_EQ(g2.window_of(0), 4096);  // even layers slide
  EXPECT_EQ(g2.window_of(1), std::nullopt);
  EXPECT_EQ(g2.rope_theta, 10000.0);
  EXPECT_FALSE(g2.sliding_rope_theta.has_value());
  const LlamaConfig nulls = LlamaConfig::from_json(config_json(
      "Gemma2ForCausalLM", R"(, "attn_logit_softcapping": null, "final_logit_softcapping": null)"));
  EXPECT_FALSE(nulls.attn_logit_softcapping || nulls.final_logit_softcapping);

  const LlamaConfig g3 =
      LlamaConfig::from_json(config_json("Gemma3ForCausalLM", R"(, "num_hidden_layers": 12)"));
  EXPECT_TRUE(g3.sandwich_norms && g3.qk_norm && !g3.qk_norm_full_width);
  EXPECT_FALSE(g3.attn_logit_softcapping || g3.final_logit_softcapping);
  EXPECT_EQ(g3.max_position_embeddings, 131072);
  for (int64_t i = 0; i < 12; ++i) {  // 5 sliding, then 1 full
    EXPECT_EQ(g3.window_of(i).has_value(), (i + 1) % 6 != 0) << i;
  }
  EXPECT_EQ(g3.rope_theta, 1000000.0);
  EXPECT_EQ(g3.sliding_rope_theta, 10000.0);
  EXPECT_FALSE(g3.rope_scaling || g3.sliding_rope_scaling);
  // transformers 4's spelling: rope_scaling (the full layers'), rope_local_base_freq.
  const LlamaConfig v4 = LlamaConfig::from_json(
      config_json("Gemma3ForCausalLM", R"(, "sliding_window_pattern": 2, "rope_theta": 500000,
      "rope_local_base_freq": 20000, "rope_scaling": {"rope_type": "linear", "factor": 8.0})"));
  EXPECT_EQ(v4.window_of(0), 4096);
  EXPECT_EQ(v4.window_of(1), std::nullopt);
  EXPECT_EQ(v4.rope_theta, 500000.0);
  EXPECT_EQ(v4.sliding_rope_theta, 20000.0);
  ASSERT_TRUE(v4.rope_scaling);
  EXPECT_EQ(v4.rope_scaling->factor, 8.0);
  EXPECT_FALSE(v4.sliding_rope_scaling);
  EXPECT_EQ(v4.sliding_rope_config().rope_theta, 20000.0);
  EXPECT_FALSE(v4.sliding_rope_config().rope_scaling);
  // Written back as transformers 5's per-type rope_parameters, read back the same.
  const LlamaConfig back = LlamaConfig::from_json(v4.to_json());
  EXPECT_EQ(back.rope_theta, 500000.0);
  EXPECT_EQ(back.sliding_rope_theta, 20000.0);
  EXPECT_EQ(back.rope_scaling->factor, 8.0);
  EXPECT_EQ(back.layer_types, v4.layer_types);
  EXPECT_EQ(back.to_json(), v4.to_json());
  EXPECT_EQ(LlamaConfig::from_json(R"({"model_type": "gemma3_text", "hidden_size": 32,
      "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
      "vocab_size": 40})")
                .architecture,
            "Gemma3ForCausalLM");
}

TEST(FamilyConfig, GemmaRefusalsNameWhatIsUnsupported) {
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(
                    config_json("Gemma2ForCausalLM", R"(, "hidden_activation": "gelu")"));
              }),
              HasSubstr("unsupported hidden_activation 'gelu' for Gemma2ForCausalLM"));
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(
                    config_json("Gemma3ForCausalLM", R"(, "use_bidirectional_attention": true)"));
              }),
              HasSubstr("use_bidirectional_attention=true is not supported"));
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(config_json(
                    "Gemma3ForCausalLM", R"(, "rope_parameters": {"rope_type": "default"})"));
              }),
              HasSubstr("must be one object per layer type"));
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(config_json(
                    "Gemma3ForCausalLM",
                    R"(, "rope_parameters": {"sliding_attention": {"rope_type": "ntk"}})"));
              }),
              HasSubstr("unsupported rope_parameters['sliding_attention'] type 'ntk'"));
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(config_json("Gemma3ForCausalLM", R"(, "head_dim": 8,
                    "rope_parameters": {"sliding_attention": {"rope_type": "longrope",
                    "short_factor": [1, 1], "long_factor": [2, 2, 2, 2]}})"));
              }),
              HasSubstr("rope_parameters['sliding_attention'] 'short_factor' has 2 entries, but "
                        "the rotary dimension 8 needs 4"));
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(
                    config_json("Gemma2ForCausalLM", R"(, "attn_logit_softcapping": 0)"));
              }),
              HasSubstr("attn_logit_softcapping must be positive"));
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(
                    config_json("Gemma2ForCausalLM", R"(, "query_pre_attn_scalar": 12.5)"));
              }),
              HasSubstr("query_pre_attn_scalar must be an integer, got 12.5"));
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(config_json("Gemma2ForCausalLM", R"(, "hidden_size": 30)"));
              }),
              HasSubstr("is not a multiple of the number of attention heads"));
  // Tensor parallelism splits Gemma as Llama (per-head q/k norms are rank-local).
  EXPECT_NO_THROW(mdist::hf::check_tensor_parallel_split(
      LlamaConfig::from_json(config_json("Gemma3ForCausalLM")), 2));
}

TEST(FamilyConfig, Phi3LongropeTakesTheTopLevelLengthAndItsOldNames) {
  const std::string factors = R"("short_factor": [1, 1, 1, 1], "long_factor": [2, 2, 2, 2])";
  for (const char* type : {"longrope", "su", "yarn"}) {
    const LlamaConfig c = LlamaConfig::from_json(
        config_json("Phi3ForCausalLM", R"(, "original_max_position_embeddings": 16,
        "rope_scaling": {"type": ")" + std::string(type) +
                                           R"(", )" + factors + "}"));
    ASSERT_TRUE(c.rope_scaling) << type;
    EXPECT_EQ(c.rope_scaling->rope_type, "longrope") << type;
    EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 16) << type;
    // Written back where transformers reads it first.
    const auto j = nlohmann::json::parse(c.to_json());
    EXPECT_EQ(j.at("original_max_position_embeddings"), 16);
    EXPECT_EQ(LlamaConfig::from_json(c.to_json()).rope_scaling->long_factor,
              c.rope_scaling->long_factor);
  }
  // Absent at the top level: Phi3Config's 4096, not the rope object's.
  EXPECT_EQ(LlamaConfig::from_json(config_json("Phi3ForCausalLM",
                                               R"(, "rope_parameters": {"rope_type": "longrope",
                "original_max_position_embeddings": 16, "rope_theta": 10000.0, )" +
                                                   factors + "}"))
                .rope_scaling->original_max_position_embeddings,
            4096);
  // A partial rotary factor: as many factors as rotated frequencies.
  EXPECT_NO_THROW(LlamaConfig::from_json(
      config_json("Phi3ForCausalLM",
                  R"(, "partial_rotary_factor": 0.5, "rope_scaling": {"type": "longrope",
          "short_factor": [1, 1], "long_factor": [2, 2]})")));
  EXPECT_THAT(error_of([&] {
                LlamaConfig::from_json(config_json(
                    "Phi3ForCausalLM", R"(, "partial_rotary_factor": 0.5, "rope_scaling": {)" +
                                           std::string(R"("type": "longrope", )") + factors + "}"));
              }),
              HasSubstr("'short_factor' has 4 entries, but the rotary dimension 4 needs 2"));
}

TEST(FamilyConfig, RefusalsNameWhatIsUnsupported) {
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(config_json(
                    "Phi3ForCausalLM", R"(, "rope_scaling": {"type": "linear", "factor": 2})"));
              }),
              HasSubstr("type 'linear' is not supported for Phi3ForCausalLM"));
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(
                    config_json("Olmo2ForCausalLM", R"(, "partial_rotary_factor": 0.5)"));
              }),
              HasSubstr("not supported for Olmo2ForCausalLM"));
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(
                    R"({"architectures": ["Phi3ForCausalLM"], "hidden_size": 32,
                        "intermediate_size": 48, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "vocab_size": 40})");
              }),
              HasSubstr("pad_token_id defaults to 32000 for Phi3ForCausalLM"));
  // Tensor parallelism: both split by whole KV heads per rank (config_json's 2); one KV head
  // over 2 ranks is refused by name, before anything is split.
  EXPECT_NO_THROW(mdist::hf::check_tensor_parallel_split(
      LlamaConfig::from_json(config_json("Phi3ForCausalLM")), 2));
  EXPECT_NO_THROW(mdist::hf::check_tensor_parallel_split(
      LlamaConfig::from_json(config_json("Olmo2ForCausalLM")), 2));
  EXPECT_THAT(
      error_of([] {
        mdist::hf::check_tensor_parallel_split(
            LlamaConfig::from_json(config_json("Phi3ForCausalLM", R"(, "num_key_value_heads": 1)")),
            2);
      }),
      HasSubstr("Phi3ForCausalLM's fused self_attn.qkv_proj splits by whole KV heads"));
  EXPECT_THAT(error_of([] {
                mdist::hf::check_tensor_parallel_split(
                    LlamaConfig::from_json(
                        config_json("Olmo2ForCausalLM", R"(, "num_key_value_heads": 1)")),
                    2);
              }),
              HasSubstr("Olmo2ForCausalLM's self_attn.k_norm over all KV heads"));
  EXPECT_NO_THROW(mdist::hf::check_tensor_parallel_split(
      LlamaConfig::from_json(config_json("Olmo2ForCausalLM")), 1));
}

TEST(FamilyConfig, ToJsonRoundTrips) {
  for (const char* name : {"phi3", "phi3_bf16", "olmo2", "gemma2", "gemma3"}) {
    const LlamaConfig c = config_of(name);
    const LlamaConfig back = LlamaConfig::from_json(c.to_json());
    EXPECT_EQ(back.to_json(), c.to_json()) << name;
    EXPECT_EQ(back.sliding_window, c.sliding_window) << name;
    EXPECT_EQ(back.partial_rotary_factor, c.partial_rotary_factor) << name;
    EXPECT_EQ(back.qkv_bias, c.qkv_bias) << name;
    EXPECT_EQ(back.layer_types, c.layer_types) << name;
    EXPECT_EQ(back.attn_logit_softcapping, c.attn_logit_softcapping) << name;
    EXPECT_EQ(back.final_logit_softcapping, c.final_logit_softcapping) << name;
    EXPECT_EQ(back.query_pre_attn_scalar, c.query_pre_attn_scalar) << name;
  }
}

}  // namespace
