// mdist::hf RoPE kinds (rotary.h) and per-layer attention types against transformers 5.24:
// logits, loss, gradients and the rotary tables themselves of the fixtures
// make_rope_fixtures.py writes (24 tokens: beyond original_max_position_embeddings and the
// sliding windows), and LlamaConfig's reading, refusing and writing of rope kinds and
// layer_types.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/config.h"
#include "mdist/hf/rotary.h"
#include "tests/hf_model/fixture_reader.h"
#include "tests/hf_model/parity.h"

namespace {

using mdist::hf::CausalLM;
using mdist::hf::ConfigError;
using mdist::hf::LayerType;
using mdist::hf::LlamaConfig;
using mdist::test::fixture_dir;
using mdist::test::loaded;
using mdist::test::read_fixture;
using mdist::test::read_text;
using mdist::test::real_error;
using ::testing::HasSubstr;

// The fixture's config. rope_partial's is refused for Llama (its attention rotates the whole
// head in transformers; the fixture ran Phi-3's partial rotation): read it without the factor,
// then set it, to check the rotary code the partial families will use.
LlamaConfig config_of(const std::string& name) {
  if (name != "rope_partial") return LlamaConfig::from_file(fixture_dir(name) + "/config.json");
  auto j = nlohmann::json::parse(read_text(fixture_dir(name) + "/config.json"));
  const double partial = j.at("rope_parameters").at("partial_rotary_factor").get<double>();
  j.at("rope_parameters").erase("partial_rotary_factor");
  LlamaConfig c = LlamaConfig::from_json(j.dump());
  c.partial_rotary_factor = partial;
  return c;
}

class RopeParity : public ::testing::TestWithParam<std::string> {};

TEST_P(RopeParity, RotaryTablesEqualTransformers) {
  const auto fixture = read_fixture(fixture_dir(GetParam()));
  const LlamaConfig config = config_of(GetParam());
  mdist::hf::RotaryEmbedding rotary(config);
  EXPECT_TRUE(torch::equal(rotary.inv_freq(), fixture.at("rope:inv_freq"))) << GetParam();
  EXPECT_EQ(static_cast<float>(rotary.attention_scaling()),
            fixture.at("rope:attention_scaling")[0].item<float>());
  // After a forward over the fixture's positions (dynamic: grown; longrope: long factors).
  const int64_t time = fixture.at("input_ids").size(1);
  (void)rotary.cos_sin(torch::arange(time, torch::kLong).unsqueeze(0), at::kFloat);
  EXPECT_TRUE(torch::equal(rotary.inv_freq(), fixture.at("rope:inv_freq_after"))) << GetParam();
}

TEST_P(RopeParity, LogitsLossAndGradientsMatchTransformers) {
  const auto fixture = read_fixture(fixture_dir(GetParam()));
  CausalLM model = loaded(config_of(GetParam()), fixture);
  const at::Tensor logits = model->forward(fixture.at("input_ids"), fixture.at("attention_mask"));
  const double logit_error = real_error(logits, fixture);
  EXPECT_LT(logit_error, 1e-4) << GetParam();
  EXPECT_GT(fixture.at("logits").abs().max().item<double>(), 1.0);
  const at::Tensor loss = CausalLM::Impl::loss(logits, fixture.at("labels"));
  const double loss_error = std::abs(loss.item<double>() - fixture.at("loss").item<double>());
  EXPECT_LT(loss_error, 1e-5) << GetParam();

  loss.backward();
  auto params = model->named_parameters().pairs();
  std::sort(params.begin(), params.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  const at::Tensor& norms = fixture.at("grad_norms");
  ASSERT_EQ(norms.numel(), static_cast<int64_t>(params.size()));
  double worst = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const double expected = norms[static_cast<int64_t>(i)].item<double>();
    ASSERT_TRUE(params[i].second.grad().defined()) << params[i].first;
    const double relative =
        std::abs(params[i].second.grad().norm().item<double>() - expected) / expected;
    worst = std::max(worst, relative);
    EXPECT_LT(relative, 1e-4) << GetParam() << " " << params[i].first;
  }

  // Later forwards, in transformers' order: the state it keeps between them.
  double followup_error = 0;
  for (const int64_t length : {20, 12}) {
    const std::string key = "logits_" + std::to_string(length);
    if (!fixture.contains(key)) continue;
    const at::NoGradGuard no_grad;
    const at::Tensor later = model->forward(fixture.at("input_ids").slice(1, 0, length));
    const double error = (later - fixture.at(key)).abs().max().item<double>();
    EXPECT_LT(error, 1e-4) << GetParam() << " " << key;
    followup_error = std::max(followup_error, error);
  }
  std::printf(
      "[%s] max |logit error| %.3g, |loss error| %.3g, worst relative grad-norm error %.3g, "
      "later forwards %.3g\n",
      GetParam().c_str(), logit_error, loss_error, worst, followup_error);
}

INSTANTIATE_TEST_SUITE_P(Kinds, RopeParity,
                         ::testing::Values("rope_linear", "rope_dynamic", "rope_yarn",
                                           "rope_yarn_mscale", "rope_yarn_qwen3", "rope_longrope",
                                           "rope_llama3", "rope_partial", "qwen3_sliding",
                                           "qwen2_layer_types"));

// Each fixture exercises what it is for: without it, the logits of real tokens move.
TEST(RopeFixtures, DependOnTheirKindWindowsAndState) {
  const auto error_with = [](const std::string& name, auto&& change) {
    const auto fixture = read_fixture(fixture_dir(name));
    LlamaConfig config = config_of(name);
    change(config);
    CausalLM model = loaded(config, fixture);
    const at::NoGradGuard no_grad;
    return real_error(model->forward(fixture.at("input_ids"), fixture.at("attention_mask")),
                      fixture);
  };
  for (const char* name : {"rope_linear", "rope_dynamic", "rope_yarn", "rope_yarn_mscale",
                           "rope_yarn_qwen3", "rope_longrope", "rope_llama3", "rope_partial"}) {
    EXPECT_GT(error_with(name, [](LlamaConfig& c) { c.rope_scaling.reset(); }), 1e-2) << name;
  }
  EXPECT_GT(error_with("rope_yarn_mscale", [](LlamaConfig& c) { c.rope_scaling->mscale.reset(); }),
            1e-2);
  EXPECT_GT(error_with("rope_yarn_mscale", [](LlamaConfig& c) { c.rope_scaling->truncate = true; }),
            1e-3);
  EXPECT_GT(error_with("rope_yarn_qwen3",
                       [](LlamaConfig& c) { c.rope_scaling->attention_factor.reset(); }),
            1e-2);
  EXPECT_GT(error_with("rope_partial", [](LlamaConfig& c) { c.partial_rotary_factor = 1.0; }),
            1e-2);
  for (const char* name : {"qwen3_sliding", "qwen2_layer_types"}) {
    EXPECT_GT(
        error_with(name, [](LlamaConfig& c) { c.sliding_window.reset(), c.layer_types.clear(); }),
        1e-2)
        << name;
    // The window on every layer is not what transformers does either.
    EXPECT_GT(error_with(name, [](LlamaConfig& c) { c.layer_types.clear(); }), 1e-2) << name;
  }
}

// The state matters: a fresh model's 20 tokens (dynamic: frequencies of 20, not of the 24 seen
// before; longrope: long factors either way) and 12 tokens.
TEST(RopeFixtures, DynamicKeepsTheFrequenciesOfTheLongestSequenceAsTransformers) {
  const auto fixture = read_fixture(fixture_dir("rope_dynamic"));
  CausalLM fresh = loaded(config_of("rope_dynamic"), fixture);
  const at::NoGradGuard no_grad;
  const at::Tensor twenty = fresh->forward(fixture.at("input_ids").slice(1, 0, 20));
  EXPECT_GT((twenty - fixture.at("logits_20")).abs().max().item<double>(), 1e-3);
}

// --- LlamaConfig: rope kinds and layer types ------------------------------------------------

std::string llama_config(const std::string& extra = "") {
  return R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 48,
             "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 40,
             "max_position_embeddings": 64)" +
         extra + "}";
}

std::string qwen_config(const std::string& architecture, const std::string& extra, int layers = 4) {
  return R"({"architectures": [")" + architecture +
         R"("], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": )" +
         std::to_string(layers) + R"(, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 40, "head_dim": 8)" +
         extra + "}";
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError";
  return "";
}

// The same settings in transformers 4's spelling (rope_theta + rope_scaling, "type" or
// "rope_type") and 5's (rope_parameters) give the same frequencies and scaling.
TEST(RopeConfig, BothSpellingsOfEveryKindAgree) {
  const std::map<std::string, std::string> kinds = {
      {"linear", R"("factor": 2.0)"},
      {"dynamic", R"("factor": 2.0)"},
      {"yarn", R"("factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8)"},
      {"longrope",
       R"("short_factor": [1, 1.5, 2, 3], "long_factor": [1, 2, 3, 4],
          "original_max_position_embeddings": 16)"},
      {"llama3",
       R"("factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16)"}};
  for (const auto& [kind, keys] : kinds) {
    const auto v4 = LlamaConfig::from_json(llama_config(
        R"(, "rope_theta": 5000.0, "rope_scaling": {"type": ")" + kind + "\", " + keys + "}"));
    const auto v5 =
        LlamaConfig::from_json(llama_config(R"(, "rope_parameters": {"rope_type": ")" + kind +
                                            R"(", "rope_theta": 5000.0, )" + keys + "}"));
    ASSERT_TRUE(v4.rope_scaling && v5.rope_scaling) << kind;
    EXPECT_EQ(v4.rope_scaling->rope_type, kind);
    EXPECT_DOUBLE_EQ(v4.rope_theta, 5000.0);
    const auto a = mdist::hf::rope_frequencies(v4), b = mdist::hf::rope_frequencies(v5);
    EXPECT_TRUE(torch::equal(a.inv_freq, b.inv_freq)) << kind;
    EXPECT_EQ(a.attention_scaling, b.attention_scaling) << kind;
    // Not plain RoPE (dynamic is, up to max_position_embeddings; beyond, not).
    const auto plain =
        mdist::hf::rope_inv_freq(LlamaConfig::from_json(llama_config(R"(, "rope_theta": 5000.0)")));
    const auto scaled =
        kind == "dynamic" ? mdist::hf::rope_frequencies(v5, 128).inv_freq : a.inv_freq;
    EXPECT_FALSE(torch::equal(scaled, plain)) << kind;
  }
}

TEST(RopeConfig, TransformersDefaultsOfOptionalKeys) {
  // original_max_position_embeddings: max_position_embeddings (transformers' standardisation).
  const auto yarn = LlamaConfig::from_json(
      llama_config(R"(, "rope_scaling": {"rope_type": "yarn", "factor": 4.0})"));
  EXPECT_EQ(yarn.rope_scaling->original_max_position_embeddings, 64);
  // yarn with factor null: max_position_embeddings / original_max_position_embeddings.
  const auto derived = LlamaConfig::from_json(llama_config(
      R"(, "rope_scaling": {"rope_type": "yarn", "factor": null,
          "original_max_position_embeddings": 16})"));
  EXPECT_EQ(derived.rope_scaling->factor, 4.0);
  // longrope without factor: the attention factor from the same ratio.
  const auto longrope = LlamaConfig::from_json(llama_config(
      R"(, "rope_scaling": {"rope_type": "longrope", "short_factor": [1, 1, 1, 1],
          "long_factor": [1, 1, 1, 1], "original_max_position_embeddings": 16})"));
  EXPECT_DOUBLE_EQ(mdist::hf::rope_frequencies(longrope).attention_scaling,
                   std::sqrt(1 + std::log(4.0) / std::log(16.0)));
  // Both set: transformers takes rope_scaling.
  const auto both = LlamaConfig::from_json(llama_config(
      R"(, "rope_scaling": {"rope_type": "linear", "factor": 3.0},
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0})"));
  ASSERT_TRUE(both.rope_scaling);
  EXPECT_EQ(both.rope_scaling->factor, 3.0);
  // Mixtral's default theta is its config class's.
  EXPECT_DOUBLE_EQ(LlamaConfig::from_json(qwen_config("MixtralForCausalLM", "")).rope_theta, 1e6);
}

TEST(RopeConfig, RefusesMissingKeysAndUnsupportedValuesNamingThem) {
  const auto refusal = [](const std::string& extra) {
    return error_of([&] { LlamaConfig::from_json(llama_config(extra)); });
  };
  EXPECT_THAT(refusal(R"(, "rope_scaling": {"rope_type": "linear"})"),
              HasSubstr("missing required key rope_scaling 'factor' (rope_type linear)"));
  EXPECT_THAT(refusal(R"(, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4})"),
              HasSubstr("missing required key rope_parameters 'factor' (rope_type dynamic)"));
  EXPECT_THAT(
      refusal(R"(, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 8})"),
      HasSubstr("'factor'"));
  EXPECT_THAT(
      refusal(R"(, "rope_scaling": {"rope_type": "longrope", "short_factor": [1, 1, 1, 1]})"),
      HasSubstr("missing required key rope_scaling 'long_factor'"));
  EXPECT_THAT(
      refusal(R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1})"),
      HasSubstr("'high_freq_factor'"));
  EXPECT_THAT(refusal(R"(, "rope_scaling": {"rope_type": "longrope", "short_factor": [1, 1],
                           "long_factor": [1, 1, 1, 1]})"),
              HasSubstr("'short_factor' has 2 entries, but the rotary dimension 8 needs 4"));
  EXPECT_THAT(refusal(R"(, "rope_scaling": {"rope_type": "longrope", "short_factor": 1,
                           "long_factor": [1, 1, 1, 1]})"),
              HasSubstr("'short_factor' is not a list of numbers"));
  EXPECT_THAT(refusal(R"(, "rope_scaling": {"rope_type": "linear", "factor": "2"})"),
              HasSubstr("key 'factor' has the wrong type"));
  EXPECT_THAT(refusal(R"(, "rope_scaling": {"rope_type": "linear", "factor": 0})"),
              HasSubstr("'factor' (rope_type linear) must be positive"));
  EXPECT_THAT(refusal(R"(, "rope_scaling": {"rope_type": "proportional", "factor": 2})"),
              HasSubstr("unsupported rope_scaling type 'proportional' (supported: default, linear, "
                        "dynamic, yarn, longrope, llama3)"));
  EXPECT_THAT(refusal(R"(, "partial_rotary_factor": 0.5)"),
              HasSubstr("partial_rotary_factor 0.500000 is not supported for LlamaForCausalLM"));
  EXPECT_THAT(
      refusal(R"(, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 2})"),
      HasSubstr("partial_rotary_factor must be in (0, 1]"));
  EXPECT_THAT(refusal(R"(, "rope_parameters": {"full_attention": {"rope_type": "default"},
                           "sliding_attention": {"rope_type": "default"}})"),
              HasSubstr("rope_parameters per layer type ('full_attention') is not supported"));
}

// to_json writes what it read, in the spelling it was read in, for every kind.
TEST(RopeConfig, SavedConfigReadsBackTheSame) {
  const std::vector<std::string> ropes = {
      R"("rope_scaling": {"type": "linear", "factor": 2.0, "extra_key": 1}, "rope_theta": 5e5)",
      R"("rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})",
      R"("rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
         "original_max_position_embeddings": 16, "mscale": 0.707, "mscale_all_dim": 1.0,
         "truncate": false, "beta_fast": 16, "beta_slow": 2, "attention_factor": 0.9})",
      R"("rope_scaling": {"rope_type": "longrope", "short_factor": [1, 1.5, 2, 3],
         "long_factor": [1, 2, 3, 4], "original_max_position_embeddings": 16, "factor": 4.0})"};
  for (const auto& rope : ropes) {
    const auto c = LlamaConfig::from_json(llama_config(", " + rope));
    const auto saved = nlohmann::json::parse(c.to_json());
    const bool v5 = rope.find("rope_parameters") != std::string::npos;
    EXPECT_EQ(saved.contains("rope_parameters"), v5) << rope;
    const auto& object = saved.at(v5 ? "rope_parameters" : "rope_scaling");
    const auto source =
        nlohmann::json::parse("{" + rope + "}").at(v5 ? "rope_parameters" : "rope_scaling");
    for (const auto& [key, value] : source.items()) {
      if (key == "type") {
        EXPECT_EQ(object.at("rope_type"), value);
        continue;
      }
      ASSERT_TRUE(object.contains(key)) << key << " in " << object.dump();
      EXPECT_EQ(object.at(key), value) << key;
    }
    const auto back = LlamaConfig::from_json(c.to_json());
    EXPECT_TRUE(torch::equal(mdist::hf::rope_inv_freq(back), mdist::hf::rope_inv_freq(c)));
    EXPECT_EQ(mdist::hf::rope_frequencies(back).attention_scaling,
              mdist::hf::rope_frequencies(c).attention_scaling);
    EXPECT_EQ(back.to_json(), c.to_json());
  }
}

std::vector<LayerType> types(const std::string& pattern) {  // "fs": full, sliding
  std::vector<LayerType> out;
  for (const char t : pattern) {
    out.push_back(t == 's' ? LayerType::kSlidingAttention : LayerType::kFullAttention);
  }
  return out;
}

// Qwen2Config / Qwen3Config: layers from max_window_layers on slide; Qwen2MoeConfig: the
// even-numbered layers below it; Qwen3-MoE, Mistral, Mixtral: the window on every layer.
TEST(LayerTypes, DerivedAsTransformersConfigClassesDeriveThem) {
  const std::string window = R"(, "use_sliding_window": true, "sliding_window": 6)";
  for (const char* arch : {"Qwen2ForCausalLM", "Qwen3ForCausalLM"}) {
    const auto c =
        LlamaConfig::from_json(qwen_config(arch, window + R"(, "max_window_layers": 2)"));
    EXPECT_EQ(c.layer_types, types("ffss")) << arch;
    EXPECT_EQ(c.window_of(1), std::nullopt);
    EXPECT_EQ(c.window_of(2), 6);
    // Without use_sliding_window there is no window, whatever max_window_layers says.
    const auto off = LlamaConfig::from_json(qwen_config(arch, R"(, "max_window_layers": 0)"));
    EXPECT_EQ(off.layer_types, types("ffff"));
    EXPECT_FALSE(off.sliding_window);
  }
  const auto moe = LlamaConfig::from_json(
      qwen_config("Qwen2MoeForCausalLM", window + R"(, "max_window_layers": 3, "num_experts": 4)"));
  EXPECT_EQ(moe.layer_types, types("sfsf"));
  const auto qwen3_moe = LlamaConfig::from_json(qwen_config(
      "Qwen3MoeForCausalLM", window + R"(, "num_experts": 4, "num_experts_per_tok": 2)"));
  EXPECT_TRUE(qwen3_moe.layer_types.empty());
  EXPECT_EQ(qwen3_moe.window_of(0), 6);
  const auto mistral = LlamaConfig::from_json(qwen_config("MistralForCausalLM", ""));
  EXPECT_EQ(mistral.window_of(3), 4096);
  // Explicit layer_types win over the derivation ("attention": transformers' legacy name).
  const auto given = LlamaConfig::from_json(
      qwen_config("Qwen3ForCausalLM",
                  window + R"(, "layer_types": ["sliding_attention", "attention", "full_attention",
                                     "sliding_attention"])"));
  EXPECT_EQ(given.layer_types, types("sffs"));
}

TEST(LayerTypes, RefusedWhenUnknownMiscountedOrWithoutAWindow) {
  const auto refusal = [](const std::string& extra) {
    return error_of([&] { LlamaConfig::from_json(qwen_config("Qwen3ForCausalLM", extra, 2)); });
  };
  EXPECT_THAT(refusal(R"(, "layer_types": ["full_attention", "chunked_attention"])"),
              HasSubstr("unsupported layer type 'chunked_attention' in layer_types (supported: "
                        "full_attention, sliding_attention)"));
  EXPECT_THAT(refusal(R"(, "layer_types": ["full_attention"])"),
              HasSubstr("layer_types has 1 entries for 2 layers"));
  EXPECT_THAT(refusal(R"(, "layer_types": ["full_attention", "sliding_attention"])"),
              HasSubstr("layer 1 sliding_attention, but there is no sliding_window"));
  EXPECT_THAT(refusal(R"(, "layer_types": "full_attention")"),
              HasSubstr("'layer_types' is not a list"));
  // Validated for Llama too (transformers validates any config's layer_types).
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(llama_config(R"(, "layer_types": ["linear_attention",
                                                         "full_attention"])"));
              }),
              HasSubstr("unsupported layer type 'linear_attention'"));
}

TEST(LayerTypes, SavedConfigReadsBackTheSame) {
  const auto c = LlamaConfig::from_json(
      qwen_config("Qwen2ForCausalLM", R"(, "use_sliding_window": true, "sliding_window": 6,
                              "max_window_layers": 1)"));
  const auto back = LlamaConfig::from_json(c.to_json());
  EXPECT_EQ(back.layer_types, c.layer_types);
  EXPECT_EQ(back.sliding_window, 6);
  const auto j = nlohmann::json::parse(c.to_json());
  EXPECT_EQ(j.at("layer_types"), nlohmann::json({"full_attention", "sliding_attention",
                                                 "sliding_attention", "sliding_attention"}));
  EXPECT_EQ(j.at("use_sliding_window"), true);
}

}  // namespace
