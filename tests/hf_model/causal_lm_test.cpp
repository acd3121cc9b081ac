// mdist::hf::LlamaConfig and CausalLM against transformers: logits and loss of tiny random
// models of each supported architecture (fixtures/<arch>/, written by make_fixtures.py).
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "mdist/error.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/hf/config.h"
#include "mdist/hf/generate.h"
#include "mdist/hf/kv_cache.h"
#include "mdist/hf/pretrained.h"
#include "mdist/hf/safetensors.h"
#include "mdist/nn/hooks.h"
#include "tests/hf_model/fixture_reader.h"

namespace {

using mdist::hf::CausalLM;
using mdist::hf::ConfigError;
using mdist::hf::LlamaConfig;
using mdist::test::fixture_dir;
using mdist::test::is_weight;
using mdist::test::read_fixture;
using mdist::test::read_text;
using mdist::test::weights_of;
using ::testing::HasSubstr;

CausalLM loaded_model(const std::string& arch, std::map<std::string, at::Tensor>& fixture) {
  fixture = read_fixture(fixture_dir(arch));
  CausalLM model(LlamaConfig::from_file(fixture_dir(arch) + "/config.json"));
  mdist::hf::load_state_dict(model, weights_of(fixture));
  model->eval();
  return model;
}

class Parity : public ::testing::TestWithParam<std::string> {};

TEST_P(Parity, ParameterNamesAreTheCheckpointKeys) {
  const auto fixture = read_fixture(fixture_dir(GetParam()));
  const CausalLM model(LlamaConfig::from_file(fixture_dir(GetParam()) + "/config.json"));
  std::set<std::string> params, keys;
  for (const auto& item : model->named_parameters()) params.insert(item.key());
  for (const auto& [name, t] : fixture) {
    if (is_weight(name)) keys.insert(name);
  }
  EXPECT_EQ(params, keys);
  EXPECT_TRUE(model->named_buffers().is_empty());
}

TEST_P(Parity, LogitsAndLossMatchTransformers) {
  std::map<std::string, at::Tensor> fixture;
  CausalLM model = loaded_model(GetParam(), fixture);
  const at::NoGradGuard no_grad;
  const at::Tensor& ids = fixture.at("input_ids");
  const at::Tensor& mask = fixture.at("attention_mask");
  const at::Tensor& expected = fixture.at("logits");

  const at::Tensor logits = model->forward(ids, mask);
  ASSERT_EQ(logits.sizes(), expected.sizes());
  ASSERT_EQ(logits.scalar_type(), at::kFloat);
  // Padding positions' logits are unspecified (HF's and ours differ); compare real tokens.
  const at::Tensor real = mask.to(at::kBool);
  const double logit_error = (logits - expected).abs().index({real}).max().item<double>();
  EXPECT_LT(logit_error, 1e-4) << GetParam();
  EXPECT_GT(expected.abs().max().item<double>(), 1.0);  // not a trivially small signal

  const at::Tensor loss = CausalLM::Impl::loss(logits, fixture.at("labels"));
  const double loss_error = std::abs(loss.item<double>() - fixture.at("loss").item<double>());
  EXPECT_LT(loss_error, 1e-5) << GetParam();
  std::printf("[%s] max |logit error| %.3g, |loss error| %.3g\n", GetParam().c_str(), logit_error,
              loss_error);

  // Row 0 has no padding: without a mask (the is_causal path) it gives the same logits, and
  // explicit position ids 0..T-1 are the default.
  const at::Tensor row = ids.slice(0, 0, 1);
  const at::Tensor plain = model->forward(row);
  EXPECT_LT((plain - expected.slice(0, 0, 1)).abs().max().item<double>(), 1e-4);
  const at::Tensor positions = torch::arange(row.size(1), torch::kLong).unsqueeze(0);
  EXPECT_TRUE(torch::allclose(model->forward(row, {}, positions), plain, 0, 0));
  if (fixture.contains("position_ids")) {  // llama: positions counted from the first token
    const at::Tensor shifted = model->forward(ids, mask, fixture.at("position_ids"));
    const double error =
        (shifted - fixture.at("logits_with_position_ids")).abs().index({real}).max().item<double>();
    EXPECT_LT(error, 1e-4);
  }
  // RoPE is relative: shifting every position changes (almost) nothing, spreading them does.
  EXPECT_TRUE(torch::allclose(model->forward(row, {}, positions + 3), plain, 1e-4, 1e-4));
  EXPECT_FALSE(torch::allclose(model->forward(row, {}, positions * 2), plain, 1e-3, 1e-3));
}

// The fixtures exercise Llama 3 RoPE scaling, Mistral's sliding window and the padding mask:
// without each, the logits of real tokens move.
TEST(ParityFixtures, FixturesDependOnRopeScalingSlidingWindowAndPadding) {
  const auto error_without = [](const std::string& arch, auto&& change, bool use_mask) {
    const auto fixture = read_fixture(fixture_dir(arch));
    LlamaConfig config = LlamaConfig::from_file(fixture_dir(arch) + "/config.json");
    change(config);
    CausalLM model(config);
    mdist::hf::load_state_dict(model, weights_of(fixture));
    const at::NoGradGuard no_grad;
    const at::Tensor& mask = fixture.at("attention_mask");
    const at::Tensor logits =
        model->forward(fixture.at("input_ids"), use_mask ? mask : at::Tensor());
    return (logits - fixture.at("logits")).abs().index({mask.to(at::kBool)}).max().item<double>();
  };
  EXPECT_GT(error_without(
                "llama", [](LlamaConfig& c) { c.rope_scaling.reset(); }, true),
            1e-2);
  EXPECT_GT(error_without(
                "mistral", [](LlamaConfig& c) { c.sliding_window.reset(); }, true),
            1e-2);
  EXPECT_GT(error_without(
                "qwen2", [](LlamaConfig&) {}, false),
            1e-2);
}

// The loss transformers trains a mixture of experts on (output_router_logits): the language
// model's plus router_aux_loss_coef times the load-balancing loss; just the former otherwise.
at::Tensor training_loss(CausalLM& model, const std::map<std::string, at::Tensor>& fixture) {
  const at::Tensor& mask = fixture.at("attention_mask");
  const at::Tensor loss =
      CausalLM::Impl::loss(model->forward(fixture.at("input_ids"), mask), fixture.at("labels"));
  if (!model->config.moe) return loss;
  return loss + model->config.moe->router_aux_loss_coef * model->aux_loss(mask);
}

TEST_P(Parity, BackwardGivesFiniteGradientsForEveryParameter) {
  std::map<std::string, at::Tensor> fixture;
  CausalLM model = loaded_model(GetParam(), fixture);
  const at::Tensor loss = training_loss(model, fixture);
  if (fixture.contains("total_loss")) {
    EXPECT_NEAR(loss.item<double>(), fixture.at("total_loss").item<double>(), 1e-5);
  }
  loss.backward();
  auto params = model->named_parameters().pairs();
  std::sort(params.begin(), params.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  const at::Tensor& norms = fixture.at("grad_norms");
  ASSERT_EQ(norms.numel(), static_cast<int64_t>(params.size()));
  double worst = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto& [name, param] = params[i];
    const double expected = norms[static_cast<int64_t>(i)].item<double>();
    // An expert no token chose gets no gradient, in transformers as here.
    if (expected == 0 && name.find(".experts.") != std::string::npos) {
      EXPECT_FALSE(param.grad().defined() && param.grad().abs().max().item<double>() > 0) << name;
      continue;
    }
    ASSERT_TRUE(param.grad().defined()) << name;
    const double relative = std::abs(param.grad().norm().item<double>() - expected) / expected;
    worst = std::max(worst, relative);
    EXPECT_LT(relative, 1e-4) << GetParam() << " " << name;
  }
  if (!fixture.contains("grad:model.embed_tokens.weight")) return;
  const at::Tensor& embed_grad = fixture.at("grad:model.embed_tokens.weight");
  const double embed_error =
      (model->model->embed_tokens->weight.grad() - embed_grad).abs().max().item<double>();
  EXPECT_LT(embed_error, 1e-5) << GetParam();
  std::printf("[%s] worst relative grad-norm error %.3g, max |embed grad error| %.3g\n",
              GetParam().c_str(), worst, embed_error);
  if (model->config.pad_token_id) {  // llama: the padding row gets no gradient, as in HF
    const int64_t pad = *model->config.pad_token_id;
    EXPECT_TRUE(fixture.at("input_ids").eq(pad).any().item<bool>());
    EXPECT_EQ(model->model->embed_tokens->weight.grad()[pad].abs().max().item<double>(), 0.0);
  }
}

TEST(ParityFixtures, Bfloat16ForwardStaysCloseToFloat32) {
  std::map<std::string, at::Tensor> fixture;
  CausalLM model = loaded_model("qwen3", fixture);
  model->to(at::kBFloat16);
  const at::NoGradGuard no_grad;
  const at::Tensor& mask = fixture.at("attention_mask");
  const at::Tensor logits = model->forward(fixture.at("input_ids"), mask);
  EXPECT_EQ(logits.scalar_type(), at::kBFloat16);
  const at::Tensor& expected = fixture.at("logits");
  const double error =
      (logits.to(at::kFloat) - expected).abs().index({mask.to(at::kBool)}).max().item<double>();
  EXPECT_LT(error, 0.05 * expected.abs().max().item<double>());
  const at::Tensor loss = CausalLM::Impl::loss(logits, fixture.at("labels"));
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  EXPECT_NEAR(loss.item<double>(), fixture.at("loss").item<double>(), 0.05);
}

INSTANTIATE_TEST_SUITE_P(Architectures, Parity,
                         ::testing::Values("llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
                                           "qwen3_moe_norm", "qwen3_moe_ties", "qwen2_moe",
                                           "mixtral"));

// --- Key/value cache ----------------------------------------------------------------------

// Logits of decoding with a KvCache, `chunks` tokens per forward after a prefill of `prefill`
// tokens, against one forward of the whole sequence with the same mask and position ids.
double cached_decoding_error(CausalLM& model, const at::Tensor& ids, const at::Tensor& mask,
                             int64_t prefill, int64_t chunk) {
  const int64_t time = ids.size(1);
  const at::Tensor positions =
      mask.defined() ? mdist::hf::generation_position_ids(mask, time) : at::Tensor();
  const at::Tensor full = model->forward(ids, mask, positions);
  mdist::hf::KvCache cache(model->config.num_hidden_layers);
  std::vector<at::Tensor> steps;
  for (int64_t start = 0; start < time;) {
    const int64_t n = std::min(start == 0 ? prefill : chunk, time - start);
    const at::Tensor step_mask = mask.defined() ? mask.slice(1, 0, start + n) : at::Tensor();
    const at::Tensor step_positions =
        mask.defined() ? mdist::hf::generation_position_ids(step_mask, n) : at::Tensor();
    steps.push_back(
        model->forward(ids.slice(1, start, start + n), step_mask, step_positions, &cache));
    start += n;
    EXPECT_EQ(cache.length(), start);
  }
  const at::Tensor cached = at::cat(steps, 1);
  EXPECT_EQ(cached.sizes(), full.sizes());
  const at::Tensor difference = (cached - full).abs();
  if (!mask.defined()) return difference.max().item<double>();
  return difference.index({mask.to(at::kBool)}).max().item<double>();  // padding is unspecified
}

class CachedDecoding : public ::testing::TestWithParam<std::string> {};

TEST_P(CachedDecoding, EqualsTheFullForwardWithAndWithoutLeftPadding) {
  std::map<std::string, at::Tensor> fixture;
  CausalLM model = loaded_model(GetParam(), fixture);
  const at::NoGradGuard no_grad;
  torch::manual_seed(7);
  // 24 tokens: past Mistral's window of 5 (and every other fixture's positions are enough).
  const int64_t time = 24;
  ASSERT_LE(time, model->config.max_position_embeddings);
  const at::Tensor ids = torch::randint(model->config.vocab_size, {2, time}, torch::kLong);
  at::Tensor mask = torch::ones({2, time}, torch::kLong);
  mask.index_put_({1, torch::indexing::Slice(0, 4)}, 0);  // row 1 left-padded by 4
  for (const int64_t prefill : {1, 7}) {
    for (const int64_t chunk : {1, 3}) {
      const double padded = cached_decoding_error(model, ids, mask, prefill, chunk);
      const double plain = cached_decoding_error(model, ids, {}, prefill, chunk);
      // Absolute on logits up to about 8: the cached and full forwards run matmuls of other
      // shapes, whose blocking (and so summation order) depends on the CPU's kernels:
      // below 1e-5 where the test was written, 1.1e-5 on an AVX-512 AMD EPYC (Qwen2, 2026-12-07).
      EXPECT_LT(padded, 3e-5) << GetParam() << " prefill " << prefill << " chunk " << chunk;
      EXPECT_LT(plain, 3e-5) << GetParam() << " prefill " << prefill << " chunk " << chunk;
    }
  }
}

TEST(CachedDecoding, CacheHoldsKvHeadsAndRefusesAnotherBatch) {
  std::map<std::string, at::Tensor> fixture;
  CausalLM model = loaded_model("mistral", fixture);  // 4 query heads, 2 KV heads
  const at::NoGradGuard no_grad;
  mdist::hf::KvCache cache(model->config.num_hidden_layers);
  EXPECT_EQ(cache.length(), 0);
  model->forward(torch::zeros({2, 3}, torch::kLong), {}, {}, &cache);
  const at::Tensor k =
      torch::zeros({2, model->config.num_key_value_heads, 1, model->config.head_dim});
  // What the layer holds: KV heads, not query heads (the append returns it all).
  const auto [keys, values] = cache.layer(0).append(k, k);
  EXPECT_EQ(keys.sizes(), (std::vector<int64_t>{2, 2, 4, model->config.head_dim}));
  EXPECT_THAT(
      [&] {
        model->forward(torch::zeros({3, 1}, torch::kLong), {}, {}, &cache);
      },
      ::testing::ThrowsMessage<mdist::Error>(HasSubstr("do not continue the cache")));
  mdist::hf::KvCache short_cache(1);
  EXPECT_THAT(
      [&] {
        model->forward(torch::zeros({1, 1}, torch::kLong), {}, {}, &short_cache);
      },
      ::testing::ThrowsMessage<mdist::Error>(HasSubstr("a KvCache of 1 layers")));
  // Positions counted from each row's first real token, padding 1 (as transformers' generate).
  const at::Tensor mask = torch::tensor({0, 0, 1, 1, 1, 0, 1, 1, 1, 1}).view({2, 5});
  EXPECT_TRUE(torch::equal(mdist::hf::generation_position_ids(mask, 5),
                           torch::tensor({1, 1, 0, 1, 2, 1, 0, 1, 2, 3}).view({2, 5})));
  EXPECT_TRUE(torch::equal(mdist::hf::generation_position_ids(mask, 1),
                           torch::tensor({2, 3}).view({2, 1})));
}

// Greedy generation against transformers' model.generate (with its cache), generate.json of
// make_generate_fixtures.py: each prompt alone and all of them as one left-padded batch.
TEST_P(CachedDecoding, GreedyGenerationEqualsTransformersGenerate) {
  std::map<std::string, at::Tensor> fixture;
  CausalLM model = loaded_model(GetParam(), fixture);
  const auto expected =
      nlohmann::json::parse(read_text(fixture_dir(GetParam()) + "/generate.json"));
  mdist::hf::GenerationOptions options;
  options.max_new_tokens = expected.at("max_new_tokens").get<int64_t>();
  options.eos_token_ids = mdist::hf::eos_token_ids(model->config);
  EXPECT_EQ(options.eos_token_ids, expected.at("eos_token_id").get<std::vector<int64_t>>());
  if (model->config.pad_token_id) options.pad_token_id = *model->config.pad_token_id;
  ASSERT_EQ(expected.at("cases").size(), 4u);
  for (const auto& c : expected.at("cases")) {
    const auto prompts = c.at("prompts").get<std::vector<std::vector<int64_t>>>();
    const auto outputs = mdist::hf::generate(model, prompts, options);
    EXPECT_EQ(outputs, c.at("outputs").get<std::vector<std::vector<int64_t>>>())
        << GetParam() << " " << prompts.size() << " prompt(s)";
  }
}

TEST(Generate, RefusesWhatCannotBeGenerated) {
  std::map<std::string, at::Tensor> fixture;
  CausalLM model = loaded_model("llama", fixture);  // 64 positions
  mdist::hf::GenerationOptions options;
  options.max_new_tokens = 60;
  const auto refused = [&](const std::vector<std::vector<int64_t>>& prompts,
                           const std::string& message) {
    EXPECT_THAT([&] { mdist::hf::generate(model, prompts, options); },
                ::testing::ThrowsMessage<mdist::Error>(HasSubstr(message)));
  };
  refused({{1, 2, 3, 4, 5}}, "exceed the model's max_position_embeddings 64");
  refused({}, "no prompts");
  refused({{1}, {}}, "an empty prompt");
  options.max_new_tokens = 4;
  options.greedy = false;
  options.top_p = 0;
  refused({{1}}, "top_p must be in (0, 1]");
  options.top_p = 1;
  options.temperature = std::nan("");
  refused({{1}}, "temperature must be a positive number");
}

// Sampling: top_k 1 and a tiny top_p are greedy; a seed gives the same tokens again.
TEST(Generate, SamplingKeepsTheLikeliestAndFollowsTheSeed) {
  std::map<std::string, at::Tensor> fixture;
  CausalLM model = loaded_model("qwen3", fixture);
  const std::vector<std::vector<int64_t>> prompts = {{3, 1, 4, 1, 5}, {9, 2}};
  mdist::hf::GenerationOptions greedy;
  greedy.max_new_tokens = 12;
  const auto expected = mdist::hf::generate(model, prompts, greedy);
  mdist::hf::GenerationOptions sampled = greedy;
  sampled.greedy = false;
  sampled.temperature = 0.7;
  sampled.top_k = 1;
  EXPECT_EQ(mdist::hf::generate(model, prompts, sampled), expected);
  sampled.top_k = 0;
  sampled.top_p = 1e-6;
  EXPECT_EQ(mdist::hf::generate(model, prompts, sampled), expected);
  sampled.top_p = 1;
  sampled.temperature = 5;  // nearly uniform over 40 tokens: a different seed differs
  sampled.seed = 1;
  const auto first = mdist::hf::generate(model, prompts, sampled);
  EXPECT_EQ(mdist::hf::generate(model, prompts, sampled), first);
  sampled.seed = 2;
  EXPECT_NE(mdist::hf::generate(model, prompts, sampled), first);
  // top_p drops the least likely tokens whose probabilities add up to at most 1 - p: of
  // probabilities 0.5, 0.3, 0.2, p = 0.6 keeps the first two, p = 0.4 the first alone.
  const at::Tensor logits = torch::tensor({0.5, 0.3, 0.2}).log().view({1, 3}).repeat({200, 1});
  auto generator = at::make_generator<at::CPUGeneratorImpl>(3);
  sampled.temperature = 1;
  sampled.top_p = 0.6;
  const at::Tensor two = mdist::hf::choose_tokens(logits, sampled, generator);
  EXPECT_TRUE(two.lt(2).all().item<bool>());
  EXPECT_TRUE(two.eq(1).any().item<bool>());
  sampled.top_p = 0.4;
  EXPECT_TRUE(mdist::hf::choose_tokens(logits, sampled, generator).eq(0).all().item<bool>());
}

INSTANTIATE_TEST_SUITE_P(Architectures, CachedDecoding,
                         ::testing::Values("llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
                                           "qwen3_moe_norm", "qwen3_moe_ties", "qwen2_moe",
                                           "mixtral"));

// --- Mixtures of experts -----------------------------------------------------------------

class MoeParity : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeParity, AuxLossAndRouterLogitsMatchTransformers) {
  std::map<std::string, at::Tensor> fixture;
  CausalLM model = loaded_model(GetParam(), fixture);
  const at::NoGradGuard no_grad;
  const at::Tensor& mask = fixture.at("attention_mask");
  const at::Tensor logits = model->forward(fixture.at("input_ids"), mask);
  const double logit_error =
      (logits - fixture.at("logits")).abs().index({mask.to(at::kBool)}).max().item<double>();
  EXPECT_LT(logit_error, 1e-5) << GetParam();
  const auto& c = model->config;
  int64_t sparse = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) sparse += c.sparse_layer(i) ? 1 : 0;
  const auto router_logits = model->router_logits();
  ASSERT_EQ(static_cast<int64_t>(router_logits.size()), sparse);
  for (const auto& l : router_logits) {
    EXPECT_EQ(l.sizes(), (std::vector<int64_t>{mask.numel(), c.moe->num_experts}));
  }
  const double aux = model->aux_loss(mask).item<double>();
  // Without a mask padding counts too, whose states are unspecified: row 0 has none.
  (void)model->forward(fixture.at("input_ids").slice(0, 0, 1));
  const double aux_no_mask = model->aux_loss().item<double>();
  EXPECT_NEAR(aux, fixture.at("aux_loss").item<double>(), 1e-5) << GetParam();
  EXPECT_NEAR(aux_no_mask, fixture.at("aux_loss_no_mask").item<double>(), 1e-5) << GetParam();
  EXPECT_GT(std::abs(aux - aux_no_mask), 1e-4);  // the padding mask matters in the fixture
  const double loss = CausalLM::Impl::loss(logits, fixture.at("labels")).item<double>();
  EXPECT_NEAR(loss, fixture.at("loss").item<double>(), 1e-5) << GetParam();
  EXPECT_NEAR(loss + c.moe->router_aux_loss_coef * aux, fixture.at("total_loss").item<double>(),
              1e-5);
  std::printf("[%s] max |logit error| %.3g, aux %.6f (transformers %.6f)\n", GetParam().c_str(),
              logit_error, aux, fixture.at("aux_loss").item<double>());
}

// transformers 5's fused expert tensors (as its state_dict holds them) load to the same model.
TEST_P(MoeParity, FusedExpertLayoutLoadsTheSameModel) {
  std::map<std::string, at::Tensor> fixture;
  CausalLM model = loaded_model(GetParam(), fixture);
  std::map<std::string, at::Tensor> fused;
  for (const auto& [name, t] : fixture) {
    if (name.starts_with("fused:")) fused[name.substr(6)] = t;
  }
  ASSERT_FALSE(fused.empty());
  std::map<std::string, at::Tensor> weights;
  for (const auto& [name, t] : weights_of(fixture)) {
    const bool replaced = name.find(".experts.") != std::string::npos ||
                          (model->config.moe->mixtral_names && name.ends_with(".gate.weight"));
    if (!replaced) weights[name] = t;
  }
  weights.insert(fused.begin(), fused.end());
  CausalLM from_fused(model->config);
  mdist::hf::load_state_dict(from_fused, weights);
  const auto same_as_model = [&](CausalLM& other) {
    for (const auto& item : model->named_parameters()) {
      EXPECT_TRUE(torch::equal(item.value(), other->named_parameters()[item.key()])) << item.key();
    }
  };
  same_as_model(from_fused);

  // The same as a checkpoint directory (sharded safetensors): load_pretrained, and
  // load_checkpoint_sharded reading each expert's rows of the fused tensors.
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("mdist-fused-" + std::to_string(::getpid()) + GetParam());
  std::filesystem::remove_all(dir);
  mdist::hf::save_checkpoint(dir, weights, 16 << 10);
  mdist::hf::write_file_atomically(dir / "config.json",
                                   read_text(fixture_dir(GetParam()) + "/config.json"));
  CausalLM pretrained = mdist::hf::load_pretrained(dir);
  same_as_model(pretrained);
  torch::manual_seed(3);
  CausalLM by_rows(model->config);
  mdist::hf::load_checkpoint_sharded(*by_rows, dir);
  same_as_model(by_rows);
  std::filesystem::remove_all(dir);
  // A fused tensor of the wrong shape is named.
  auto bad = weights;
  std::string key;
  for (const auto& [name, t] : fused) {
    if (name.ends_with("gate_up_proj")) key = name;
  }
  bad[key] = bad[key].slice(0, 1);
  try {
    mdist::hf::load_state_dict(from_fused, bad);
    ADD_FAILURE() << "no error";
  } catch (const mdist::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(key));
  }
}

INSTANTIATE_TEST_SUITE_P(Architectures, MoeParity,
                         ::testing::Values("qwen3_moe", "qwen3_moe_norm", "qwen3_moe_ties",
                                           "qwen2_moe", "mixtral"));

// bf16 weights with every router kept in fp32 (routing in fp32), as transformers run the same
// way; the same f16-exact weights, so the difference is only of the order of bf16 rounding.
TEST(MoeFixtures, Bfloat16ModelWithFloat32RoutersMatchesTransformers) {
  std::map<std::string, at::Tensor> fixture;
  CausalLM model = loaded_model("qwen3_moe_bf16", fixture);
  model->to(at::kBFloat16);
  for (auto& layer : model->model->decoder_layers) {
    if (layer->moe) layer->moe->gate->to(at::kFloat);
  }
  const at::Tensor& mask = fixture.at("attention_mask");
  const at::Tensor logits = model->forward(fixture.at("input_ids"), mask);
  EXPECT_EQ(logits.scalar_type(), at::kBFloat16);
  EXPECT_EQ(model->router_logits().front().scalar_type(), at::kFloat);
  const at::Tensor& expected = fixture.at("logits");
  const double error =
      (logits.to(at::kFloat) - expected).abs().index({mask.to(at::kBool)}).max().item<double>();
  EXPECT_LT(error, 0.02 * expected.abs().max().item<double>());
  const at::Tensor aux = model->aux_loss(mask);
  // Separate gate and up matmuls (transformers: one fused) round differently in bf16, so the
  // router inputs differ in the last bits.
  EXPECT_NEAR(aux.item<double>(), fixture.at("aux_loss").item<double>(), 1e-3);
  const at::Tensor loss = CausalLM::Impl::loss(logits, fixture.at("labels"));
  EXPECT_NEAR(loss.item<double>(), fixture.at("loss").item<double>(), 0.02);
  std::printf(
      "[qwen3_moe_bf16] max |logit error| %.3g (max |logit| %.3g), |loss error| %.3g, "
      "|aux error| %.3g\n",
      error, expected.abs().max().item<double>(),
      std::abs(loss.item<double>() - fixture.at("loss").item<double>()),
      std::abs(aux.item<double>() - fixture.at("aux_loss").item<double>()));
  (loss + 0.1 * aux).backward();
  for (auto& layer : model->model->decoder_layers) {
    if (!layer->moe) continue;
    ASSERT_TRUE(layer->moe->gate->weight.grad().defined());
    EXPECT_EQ(layer->moe->gate->weight.grad().scalar_type(), at::kFloat);
  }
}

// norm_topk_prob and which layers are sparse change the logits: the fixtures exercise both.
TEST(MoeFixtures, FixturesDependOnNormTopkProbAndSparseLayers) {
  const auto error_with = [](const std::string& arch, auto&& change) {
    const auto fixture = read_fixture(fixture_dir(arch));
    LlamaConfig config = LlamaConfig::from_file(fixture_dir(arch) + "/config.json");
    change(config);
    CausalLM model(config);
    mdist::hf::load_state_dict(model, weights_of(fixture));
    const at::NoGradGuard no_grad;
    const at::Tensor& mask = fixture.at("attention_mask");
    const at::Tensor logits = model->forward(fixture.at("input_ids"), mask);
    return (logits - fixture.at("logits")).abs().index({mask.to(at::kBool)}).max().item<double>();
  };
  EXPECT_LT(error_with("qwen3_moe_norm", [](LlamaConfig&) {}), 1e-4);
  EXPECT_GT(error_with("qwen3_moe_norm", [](LlamaConfig& c) { c.moe->norm_topk_prob = false; }),
            1e-2);
  // mlp_only_layers=[1] made layer 1 dense: without it, layer 1's weights do not fit.
  EXPECT_THROW(error_with("qwen3_moe", [](LlamaConfig& c) { c.moe->mlp_only_layers.clear(); }),
               mdist::Error);
}

// --- LlamaConfig ------------------------------------------------------------------------

std::string minimal_config(const std::string& extra = "") {
  return R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 48,
             "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 40)" +
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

TEST(LlamaConfig, Defaults) {
  const auto c = LlamaConfig::from_json(minimal_config());
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.rope_scaling.has_value());
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.qkv_bias || c.o_bias || c.mlp_bias || c.qk_norm);
  EXPECT_FALSE(c.pad_token_id.has_value());
  EXPECT_FALSE(LlamaConfig::from_json(minimal_config(R"(, "rope_scaling": null)")).rope_scaling);
  EXPECT_FALSE(LlamaConfig::from_json(minimal_config(
                                          R"(, "rope_parameters": {"rope_type": "default",
                                                 "rope_theta": 1e6})"))
                   .rope_scaling);
  EXPECT_DOUBLE_EQ(LlamaConfig::from_json(minimal_config(
                                              R"(, "rope_parameters": {"rope_type": "default",
                                                     "rope_theta": 1e6})"))
                       .rope_theta,
                   1e6);
}

TEST(LlamaConfig, UnsupportedArchitectureIsNamed) {
  const std::string message = error_of([] {
    LlamaConfig::from_json(R"({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8})");
  });
  EXPECT_THAT(message, HasSubstr("unsupported architecture 'GPT2LMHeadModel'"));
  EXPECT_EQ(message.find('\n'), std::string::npos);
}

// The architectures issue 30 names as still missing, spelled as their transformers 5.24
// configs: DeepSeek-V3 (multi-head latent attention), gpt-oss (attention sinks), and the
// same configs without `architectures` (the name inferred from model_type is refused too).
TEST(LlamaConfig, MissingArchitecturesAreRefusedByName) {
  struct Case {
    std::string json;
    std::string named;
  };
  const std::vector<Case> cases = {
      {R"({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           "hidden_size": 64, "kv_lora_rank": 16, "q_lora_rank": 24})",
       "unsupported architecture 'DeepseekV3ForCausalLM'"},
      {R"({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
           "num_local_experts": 4})",
       "unsupported architecture 'GptOssForCausalLM'"},
      {R"({"model_type": "deepseek_v3", "hidden_size": 64})",
       "unsupported model_type 'deepseek_v3'"},
      {R"({"model_type": "gpt_oss", "hidden_size": 64})", "unsupported model_type 'gpt_oss'"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.named);
    const std::string message = error_of([&] { LlamaConfig::from_json(c.json); });
    EXPECT_THAT(message, HasSubstr(c.named));
    EXPECT_EQ(message.find('\n'), std::string::npos);
  }
}

TEST(LlamaConfig, MissingKeyIsNamed) {
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(R"({"architectures": ["LlamaForCausalLM"],
                  "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "vocab_size": 40})");
              }),
              HasSubstr("missing required key 'intermediate_size'"));
  EXPECT_THAT(error_of([] { LlamaConfig::from_json(R"({"hidden_size": 32})"); }),
              HasSubstr("missing required key 'architectures'"));
}

// Every kind of transformers' ROPE_INIT_FUNCTIONS but proportional is supported (rope_test.cpp).
TEST(LlamaConfig, UnsupportedRopeScalingTypeIsNamed) {
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(
                    minimal_config(R"(, "rope_scaling": {"rope_type": "su", "factor": 4.0})"));
              }),
              HasSubstr("unsupported rope_scaling type 'su'"));
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(minimal_config(
                    R"(, "rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4})"));
              }),
              HasSubstr("unsupported rope_parameters type 'proportional'"));
  EXPECT_THAT(error_of([] {
                LlamaConfig::from_json(minimal_config(
                    R"(, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4})"));
              }),
              HasSubstr("missing required key rope_parameters 'factor' (rope_type dynamic)"));
}

TEST(LlamaConfig, OtherErrors) {
  EXPECT_THAT(error_of([] { LlamaConfig::from_json("{"); }), HasSubstr("not valid JSON"));
  EXPECT_THAT(
      error_of([] { LlamaConfig::from_json(minimal_config(R"(, "num_key_value_heads": 3)")); }),
      HasSubstr("not a multiple of num_key_value_heads 3"));
  EXPECT_THAT(error_of([] { LlamaConfig::from_json(minimal_config(R"(, "hidden_act": "gelu")")); }),
              HasSubstr("unsupported hidden_act 'gelu'"));
  EXPECT_THAT(error_of([] { LlamaConfig::from_json(minimal_config(R"(, "hidden_size": "x")")); }),
              HasSubstr("'hidden_size' has the wrong type"));
  EXPECT_THAT(error_of([] { LlamaConfig::from_file("/nonexistent/config.json"); }),
              HasSubstr("cannot open '/nonexistent/config.json'"));
}

TEST(LlamaConfig, Transformers4StyleRopeEqualsTransformers5Style) {
  const auto v5 = LlamaConfig::from_file(fixture_dir("llama") + "/config.json");
  const auto v4 = LlamaConfig::from_json(minimal_config(R"(, "rope_theta": 500000.0,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16})"));
  ASSERT_TRUE(v4.rope_scaling && v5.rope_scaling);
  EXPECT_DOUBLE_EQ(v4.rope_theta, v5.rope_theta);
  EXPECT_EQ(v4.rope_scaling->original_max_position_embeddings, 16);
  EXPECT_TRUE(torch::equal(mdist::hf::rope_inv_freq(v4), mdist::hf::rope_inv_freq(v5)));
}

TEST(LlamaConfig, ArchitectureFeatures) {
  const auto qwen2 = LlamaConfig::from_file(fixture_dir("qwen2") + "/config.json");
  EXPECT_TRUE(qwen2.qkv_bias);
  EXPECT_FALSE(qwen2.o_bias);
  EXPECT_TRUE(qwen2.tie_word_embeddings);
  const auto qwen3 = LlamaConfig::from_file(fixture_dir("qwen3") + "/config.json");
  EXPECT_TRUE(qwen3.qk_norm);
  EXPECT_FALSE(qwen3.qkv_bias);
  const auto mistral = LlamaConfig::from_file(fixture_dir("mistral") + "/config.json");
  EXPECT_EQ(mistral.sliding_window, 5);
  // model_type alone names the architecture.
  const auto by_type = LlamaConfig::from_json(R"({"model_type": "qwen2", "hidden_size": 32,
      "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
      "num_key_value_heads": 4, "vocab_size": 40})");
  EXPECT_EQ(by_type.architecture, "Qwen2ForCausalLM");
  EXPECT_TRUE(by_type.qkv_bias);
}

// A key left out means the default of that architecture's transformers config class (checked
// against transformers 5.24: Qwen2Config(...) has 32 KV heads, Qwen3Config a head_dim of 128,
// MistralConfig 8 KV heads and a sliding window of 4096).
TEST(LlamaConfig, AbsentKeysTakeTheArchitecturesTransformersDefaults) {
  const auto config = [](const std::string& arch, const std::string& more = "") {
    return LlamaConfig::from_json(R"({"architectures": [")" + arch +
                                  R"("], "hidden_size": 256, "intermediate_size": 48,
        "num_hidden_layers": 1, "num_attention_heads": 32, "vocab_size": 40)" +
                                  more + "}");
  };
  const auto llama = config("LlamaForCausalLM");
  EXPECT_EQ(llama.num_key_value_heads, 32);
  EXPECT_EQ(llama.head_dim, 8);
  EXPECT_EQ(llama.max_position_embeddings, 2048);
  const auto qwen2 = config("Qwen2ForCausalLM");
  EXPECT_EQ(qwen2.num_key_value_heads, 32);
  EXPECT_EQ(qwen2.head_dim, 8);
  EXPECT_EQ(qwen2.max_position_embeddings, 32768);
  EXPECT_FALSE(qwen2.sliding_window);
  const auto qwen3 = config("Qwen3ForCausalLM");
  EXPECT_EQ(qwen3.head_dim, 128);
  EXPECT_EQ(qwen3.max_position_embeddings, 32768);
  const auto mistral = config("MistralForCausalLM");
  EXPECT_EQ(mistral.num_key_value_heads, 8);
  EXPECT_EQ(mistral.head_dim, 8);
  EXPECT_EQ(mistral.max_position_embeddings, 131072);
  EXPECT_EQ(mistral.sliding_window, 4096);
  EXPECT_FALSE(config("MistralForCausalLM", R"(, "sliding_window": null)").sliding_window);
}

// As transformers 5.24: LlamaConfig refuses a hidden size the heads do not divide (even with an
// explicit head_dim); Qwen2, Qwen3 and Mistral take head_dim = hidden // heads; RoPE needs an
// even head_dim everywhere.
TEST(LlamaConfig, HeadSizesAreValidatedAsTransformersDoes) {
  const std::string heads3 = R"("hidden_size": 128, "intermediate_size": 48,
      "num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 3,
      "vocab_size": 40)";
  for (const std::string more : {"", R"(, "head_dim": 32)"}) {
    EXPECT_THAT(error_of([&] {
                  LlamaConfig::from_json(R"({"architectures": ["LlamaForCausalLM"], )" + heads3 +
                                         more + "}");
                }),
                HasSubstr("the hidden size (128) is not a multiple of the number of attention "
                          "heads (3)"));
  }
  const auto mistral =
      LlamaConfig::from_json(R"({"architectures": ["MistralForCausalLM"], )" + heads3 + "}");
  EXPECT_EQ(mistral.head_dim, 42);
  EXPECT_EQ(
      LlamaConfig::from_json(R"({"architectures": ["Qwen2ForCausalLM"], )" + heads3 + "}").head_dim,
      42);
  EXPECT_THAT(error_of([] { LlamaConfig::from_json(minimal_config(R"(, "head_dim": 7)")); }),
              HasSubstr("RoPE requires an even rotary dimension, but head_dim is 7"));
  EXPECT_THAT(
      error_of([] { LlamaConfig::from_json(minimal_config(R"(, "max_position_embeddings": 0)")); }),
      HasSubstr("max_position_embeddings must be positive"));
}

TEST(LlamaConfig, ToJsonRoundTrips) {
  for (const std::string arch : {"llama", "mistral", "qwen2", "qwen3"}) {
    const auto c = LlamaConfig::from_file(fixture_dir(arch) + "/config.json");
    const auto back = LlamaConfig::from_json(c.to_json());
    EXPECT_EQ(back.to_json(), c.to_json()) << arch;
    EXPECT_EQ(back.architecture, c.architecture);
    EXPECT_EQ(back.head_dim, c.head_dim);
    EXPECT_EQ(back.rope_scaling.has_value(), c.rope_scaling.has_value());
    EXPECT_EQ(back.qkv_bias, c.qkv_bias);
    EXPECT_EQ(back.sliding_window, c.sliding_window);
    EXPECT_EQ(nlohmann::json::parse(c.to_json()).at("bos_token_id"),
              nlohmann::json::parse(c.source_json).at("bos_token_id"));  // kept
  }
  // Built in code (no source): transformers 4 style.
  LlamaConfig c = LlamaConfig::from_json(minimal_config());
  c.source_json.clear();
  c.rope_scaling = mdist::hf::RopeScaling{};
  const auto j = nlohmann::json::parse(c.to_json());
  EXPECT_EQ(j.at("rope_scaling").at("rope_type"), "llama3");
  EXPECT_EQ(LlamaConfig::from_json(c.to_json()).rope_scaling->factor, 8.0);
}

// --- load_state_dict and hooks --------------------------------------------------------------

TEST(LoadStateDict, NamesMissingUnexpectedAndMisShapedKeys) {
  auto weights = weights_of(read_fixture(fixture_dir("llama")));
  CausalLM model(LlamaConfig::from_file(fixture_dir("llama") + "/config.json"));
  weights.erase("model.norm.weight");
  weights["model.layers.0.self_attn.q_proj.bias"] = torch::zeros({32});
  weights["lm_head.weight"] = torch::zeros({3, 3});
  try {
    mdist::hf::load_state_dict(model, weights);
    FAIL() << "no error";
  } catch (const mdist::Error& e) {
    const std::string message = e.what();
    EXPECT_THAT(message, HasSubstr("missing keys: model.norm.weight"));
    EXPECT_THAT(message, HasSubstr("unexpected keys: model.layers.0.self_attn.q_proj.bias"));
    EXPECT_THAT(message,
                HasSubstr("shape mismatch: lm_head.weight (checkpoint [3, 3], model [40, 32])"));
  }
}

TEST(LoadStateDict, TiedModelIgnoresAListedLmHead) {
  auto weights = weights_of(read_fixture(fixture_dir("qwen2")));
  CausalLM model(LlamaConfig::from_file(fixture_dir("qwen2") + "/config.json"));
  weights["lm_head.weight"] = weights.at("model.embed_tokens.weight");
  mdist::hf::load_state_dict(model, weights);
  EXPECT_TRUE(model->output_weight().is_same(model->model->embed_tokens->weight));
  weights["lm_head.weight"] = torch::zeros({2, 2});
  EXPECT_THROW(mdist::hf::load_state_dict(model, weights), mdist::Error);
}

TEST(Hooks, RootAndLayersRunTheirHooksOncePerForward) {
  CausalLM model(LlamaConfig::from_file(fixture_dir("llama") + "/config.json"));
  int root = 0, layer = 0;
  auto h1 = mdist::nn::register_forward_pre_hook(
      *model, [&](torch::nn::Module&, mdist::nn::TensorRefs&) { ++root; });
  auto h2 = mdist::nn::register_forward_pre_hook(
      *model->model->decoder_layers[1],
      [&](torch::nn::Module&, mdist::nn::TensorRefs&) { ++layer; });
  const at::NoGradGuard no_grad;
  model->forward(torch::zeros({1, 4}, torch::kLong));
  EXPECT_EQ(root, 1);
  EXPECT_EQ(layer, 1);
  h1.remove();
  h2.remove();
}

TEST(MoeConfig, KeysDefaultsAndValidation) {
  const std::string qwen = R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32,
      "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
      "vocab_size": 40)";
  const LlamaConfig d = LlamaConfig::from_json(qwen + "}");
  ASSERT_TRUE(d.moe);
  EXPECT_EQ(d.moe->num_experts, 128);  // Qwen3MoeConfig's defaults
  EXPECT_EQ(d.moe->num_experts_per_tok, 8);
  EXPECT_EQ(d.moe->moe_intermediate_size, 768);
  EXPECT_FALSE(d.moe->norm_topk_prob);
  EXPECT_DOUBLE_EQ(d.moe->router_aux_loss_coef, 0.001);
  EXPECT_TRUE(d.qk_norm);
  const LlamaConfig s = LlamaConfig::from_json(
      qwen + R"(, "decoder_sparse_step": 2, "mlp_only_layers": [3], "num_experts": 4,
               "num_experts_per_tok": 2})");
  EXPECT_FALSE(s.sparse_layer(0));
  EXPECT_TRUE(s.sparse_layer(1));
  EXPECT_FALSE(s.sparse_layer(2));
  EXPECT_FALSE(s.sparse_layer(3));
  EXPECT_EQ(LlamaConfig::from_json(s.to_json()).moe->mlp_only_layers, std::vector<int64_t>{3});
  EXPECT_EQ(LlamaConfig::from_json(qwen + R"(, "num_local_experts": 6, "num_experts_per_tok": 2})")
                .moe->num_experts,
            6);
  EXPECT_FALSE(LlamaConfig::from_json(minimal_config()).sparse_layer(0));

  const std::string mixtral = R"({"model_type": "mixtral", "hidden_size": 32,
      "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 8,
      "vocab_size": 40)";
  const LlamaConfig m = LlamaConfig::from_json(mixtral + "}");
  EXPECT_EQ(m.architecture, "MixtralForCausalLM");
  EXPECT_EQ(m.moe->num_experts, 8);
  EXPECT_EQ(m.moe->num_experts_per_tok, 2);
  EXPECT_EQ(m.moe->moe_intermediate_size, 48);
  EXPECT_TRUE(m.moe->norm_topk_prob);
  EXPECT_FALSE(m.sliding_window);
  EXPECT_TRUE(m.sparse_layer(0) && m.sparse_layer(1));

  const LlamaConfig q2 = LlamaConfig::from_json(
      R"({"model_type": "qwen2_moe", "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 16, "vocab_size": 40})");
  EXPECT_EQ(q2.architecture, "Qwen2MoeForCausalLM");
  EXPECT_EQ(q2.num_key_value_heads, 16);  // Qwen2MoeConfig's defaults
  EXPECT_EQ(q2.moe->num_experts, 60);
  EXPECT_EQ(q2.moe->num_experts_per_tok, 4);
  EXPECT_EQ(q2.moe->moe_intermediate_size, 1408);
  EXPECT_EQ(q2.moe->shared_expert_intermediate_size, 5632);
  EXPECT_TRUE(q2.qkv_bias);
  EXPECT_FALSE(q2.o_bias || q2.qk_norm);

  EXPECT_THAT(error_of([&] {
                LlamaConfig::from_json(qwen + R"(, "num_experts": 4, "num_experts_per_tok": 5})");
              }),
              HasSubstr("num_experts_per_tok 5 must be between 1 and the number of experts (4)"));
  EXPECT_THAT(error_of([&] { LlamaConfig::from_json(mixtral + R"(, "num_local_experts": 0})"); }),
              HasSubstr("num_local_experts 0 must be positive"));
  EXPECT_THAT(error_of([&] { LlamaConfig::from_json(qwen + R"(, "mlp_only_layers": [4]})"); }),
              HasSubstr("mlp_only_layers names layer 4 of 4"));
  EXPECT_THAT(error_of([&] { LlamaConfig::from_json(qwen + R"(, "decoder_sparse_step": 0})"); }),
              HasSubstr("decoder_sparse_step must be positive"));
  EXPECT_THAT(
      error_of([&] { LlamaConfig::from_json(mixtral + R"(, "router_jitter_noise": 0.1})"); }),
      HasSubstr("router_jitter_noise"));

  // A dense model has no aux loss; a sparse one has a router per sparse layer.
  CausalLM dense(LlamaConfig::from_json(minimal_config()));
  EXPECT_THROW(dense->aux_loss(), mdist::Error);
  EXPECT_TRUE(dense->router_logits().empty());
}

}  // namespace
