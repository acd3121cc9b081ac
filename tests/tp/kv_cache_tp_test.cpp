// Cached decoding under tensor parallelism, on 1-4 ranks through mdistrun: each rank caches
// its own heads; the split model's cached logits (gathered) equal the unsplit model's full
// forward, and greedy generation gives the unsplit model's tokens.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/generate.h"
#include "mdist/hf/kv_cache.h"
#include "mdist/hf/parallelize.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/mdist.h"

namespace {

using mdist::hf::CausalLM;
using mdist::hf::LlamaConfig;

LlamaConfig fixture(const std::string& name) {
  return LlamaConfig::from_file(std::string(MDIST_HF_MODEL_FIXTURES) + "/" + name + "/config.json");
}

CausalLM seeded(const LlamaConfig& config) {
  torch::manual_seed(17);
  CausalLM model(config);
  model->eval();
  return model;
}

// Prefill of 5 tokens, then one token at a time, with row 1 left-padded by 3.
void expect_cached_split_matches(const LlamaConfig& config, int t, const std::string& label) {
  const at::NoGradGuard no_grad;
  CausalLM reference = seeded(config);
  CausalLM split = seeded(config);
  const auto state = mdist::make_parallel_state({.tensor_parallel = t});
  const auto plan = mdist::hf::parallelize(split, state);
  torch::manual_seed(5);
  const int64_t time = 14;  // past mistral's sliding window of 5
  const at::Tensor ids = torch::randint(0, config.vocab_size, {2, time});
  at::Tensor mask = torch::ones({2, time}, torch::kLong);
  mask.index_put_({1, torch::indexing::Slice(0, 3)}, 0);
  const at::Tensor expected =
      reference->forward(ids, mask, mdist::hf::generation_position_ids(mask, time));

  mdist::hf::KvCache cache(config.num_hidden_layers);
  std::vector<at::Tensor> steps;
  for (int64_t start = 0; start < time;) {
    const int64_t n = start == 0 ? 5 : 1;
    const at::Tensor seen = mask.slice(1, 0, start + n);
    steps.push_back(
        plan->full_logits(split->forward(ids.slice(1, start, start + n), seen,
                                         mdist::hf::generation_position_ids(seen, n), &cache)));
    start += n;
  }
  const at::Tensor real = mask.to(at::kBool);
  const at::Tensor cached = at::cat(steps, 1);
  const double scale = std::max(1.0, expected.abs().max().item<double>());
  EXPECT_LT((cached - expected).abs().index({real}).max().item<double>(), 1e-5 * scale) << label;

  // Greedy generation: the same tokens on every rank (rank 0's, shared) as the unsplit model.
  const std::vector<std::vector<int64_t>> prompts = {{1, 2, 3, 4, 5, 6}, {7, 8}};
  mdist::hf::GenerationOptions options;
  options.max_new_tokens = 10;
  const auto unsplit = mdist::hf::generate(reference, prompts, options);
  options.full_logits = [&](const at::Tensor& logits) { return plan->full_logits(logits); };
  options.share = [](const std::vector<int64_t>& tokens) { return mdist::broadcast(tokens); };
  EXPECT_EQ(mdist::hf::generate(split, prompts, options), unsplit) << label;
}

class TpCachedDecoding : public ::testing::TestWithParam<std::string> {};

TEST_P(TpCachedDecoding, SplitCachedLogitsAndGreedyTokensEqualTheUnsplitModel) {
  for (int t = 1; t <= mdist::size(); ++t) {
    if (mdist::size() % t != 0) continue;
    LlamaConfig config = fixture(GetParam());
    if (config.num_attention_heads % t != 0) continue;  // refused by the split (tested there)
    expect_cached_split_matches(config, t, GetParam() + " tp=" + std::to_string(t));
  }
}

// One KV head shared by several ranks (replicated KV heads): each caches its copy.
TEST(TpCachedDecodingReplicatedKv, OneKvHeadOverEveryRank) {
  LlamaConfig config = fixture("llama");
  config.num_key_value_heads = 1;
  for (int t = 1; t <= mdist::size(); ++t) {
    if (mdist::size() % t != 0 || config.num_attention_heads % t != 0) continue;
    expect_cached_split_matches(config, t, "llama kv=1 tp=" + std::to_string(t));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TpCachedDecoding,
                         ::testing::Values("llama", "mistral", "qwen2", "qwen3"));

}  // namespace
