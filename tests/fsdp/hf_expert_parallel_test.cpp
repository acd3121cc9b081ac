// Expert parallelism of hf::CausalLM mixtures of experts (run by mdistrun with 1-4 ranks):
// every (dp, ep) layout the world allows gives the logits of the unsplit model, trains like one
// process on the global batch, holds only its own experts, and saves as the unsplit model.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/expert_parallel.h"
#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/hf/parallelize.h"
#include "mdist/hf/pretrained.h"
#include "mdist/hf/safetensors.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/mdist.h"
#include "tests/support/error_of.h"

namespace {

using mdist::hf::CausalLM;
using mdist::hf::LlamaConfig;
using ::testing::HasSubstr;

LlamaConfig fixture_config(const std::string& arch, int64_t num_experts) {
  LlamaConfig config =
      LlamaConfig::from_file(std::string(MDIST_HF_MODEL_FIXTURES) + "/" + arch + "/config.json");
  // 12 experts divide over 1, 2, 3, 4 and 6 ranks.
  config.moe->num_experts = num_experts;
  return config;
}

CausalLM seeded(const LlamaConfig& config) {
  torch::manual_seed(17);
  return CausalLM(config);
}

// The expert-parallel sizes this world allows for `experts` experts (ep divides the world,
// carved out of data parallelism, and the experts).
std::vector<int> layouts(int64_t experts) {
  std::vector<int> eps;
  for (int ep = 1; ep <= mdist::size(); ++ep) {
    if (mdist::size() % ep == 0 && experts % ep == 0) eps.push_back(ep);
  }
  return eps;
}

struct Split {
  mdist::ParallelState state;
  mdist::Group expert_data_parallel;
  mdist::hf::Parallelism parallelism = {};
};

Split split(CausalLM& model, int ep, bool wrap) {
  Split s{mdist::make_parallel_state({.expert_model_parallel = ep}),
          mdist::make_expert_data_parallel_group({.expert_model_parallel = ep})};
  s.parallelism.expert_parallel =
      mdist::hf::parallelize_experts(model, s.state.expert_model_parallel_group.group());
  if (wrap) {
    mdist::hf::shard_experts(model, s.expert_data_parallel, mdist::size());
    mdist::fsdp2_wrap(*model);
  }
  return s;
}

// A fresh directory name under the temporary directory, the same on every rank.
std::filesystem::path temp_dir(const std::string& stem) {
  return mdist::broadcast(
      (std::filesystem::temp_directory_path() / (stem + "-" + std::to_string(::getpid())))
          .string());
}

// `dir` loaded by load_pretrained_fsdp2 in the (W, ep) layout.
CausalLM load_in_layout(const std::filesystem::path& dir, int ep) {
  mdist::hf::Fsdp2LoadOptions options;
  options.parallel = mdist::make_parallel_state({.expert_model_parallel = ep});
  options.expert_data_parallel =
      mdist::make_expert_data_parallel_group({.expert_model_parallel = ep});
  return mdist::hf::load_pretrained_fsdp2(dir, options).model;
}

std::string file_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Every tensor a saved checkpoint directory holds.
std::map<std::string, at::Tensor> saved_tensors(const std::filesystem::path& dir) {
  const mdist::hf::SafetensorsCheckpoint checkpoint(dir);
  std::map<std::string, at::Tensor> tensors;
  for (const auto& name : checkpoint.names()) tensors[name] = checkpoint.tensor(name).clone();
  return tensors;
}

std::vector<std::string> keys_of(const std::map<std::string, at::Tensor>& tensors) {
  std::vector<std::string> keys;
  for (const auto& [name, tensor] : tensors) keys.push_back(name);
  return keys;
}

// The same dtype, shape and bytes.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || !a.sizes().equals(b.sizes())) return false;
  const auto bytes = [](const at::Tensor& t) {
    return t.cpu().contiguous().reshape({-1}).view(at::kByte);
  };
  return torch::equal(bytes(a), bytes(b));
}

class ExpertParallel : public ::testing::TestWithParam<std::string> {};

TEST_P(ExpertParallel, SameLogitsAsTheUnsplitModel) {
  const LlamaConfig config = fixture_config(GetParam(), 12);
  CausalLM reference = seeded(config);
  torch::manual_seed(3);
  const at::Tensor ids = torch::randint(0, config.vocab_size, {2, 8});
  const at::Tensor attention_mask = torch::ones({2, 8}, torch::kLong).index_put_({1, 0}, 0);
  at::Tensor expected, expected_aux;
  {
    const at::NoGradGuard no_grad;
    expected = reference->forward(ids, attention_mask);
    expected_aux = reference->aux_loss(attention_mask);
  }
  for (const int ep : layouts(config.moe->num_experts)) {
    for (const bool wrap : {false, true}) {
      CausalLM model = seeded(config);
      split(model, ep, wrap);
      // Every rank the same batch: splitting the experts must not change what one forward gives.
      const at::NoGradGuard no_grad;
      const at::Tensor logits = model->forward(ids, attention_mask);
      EXPECT_LT((logits - expected).abs().max().item<double>(), 1e-5)
          << "ep " << ep << (wrap ? " with FSDP" : "");
      EXPECT_NEAR(model->aux_loss(attention_mask).item<double>(), expected_aux.item<double>(),
                  1e-6);
    }
  }
}

// (dp, ep) = (W, ep) for each ep the world allows, each rank its share of a global batch, 4 SGD
// steps: the losses and global gradient norms of one process on the whole batch, and each
// rank's experts end as that process's same experts.
TEST_P(ExpertParallel, TrainsLikeOneProcessInEveryLayout) {
  const LlamaConfig config = fixture_config(GetParam(), 12);
  const int world = mdist::size(), me = mdist::rank();
  constexpr int kSteps = 4, kGlobalBatch = 12;
  torch::manual_seed(21);
  std::vector<at::Tensor> batches;
  for (int step = 0; step < kSteps; ++step) {
    batches.push_back(torch::randint(0, config.vocab_size, {kGlobalBatch, 8}));
  }
  CausalLM reference = seeded(config);
  // Plain SGD, not Adam: Adam's update hardly changes when a gradient is scaled, and the scale
  // of the experts' gradients (summed over ep by the all-to-all, divided by dp) is what is tested.
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.5));
  std::vector<double> ref_losses, ref_norms;
  for (const auto& batch : batches) {
    const at::Tensor loss = mdist::hf::causal_lm_loss(reference->forward(batch), batch);
    ref_opt.zero_grad();
    loss.backward();
    double squares = 0;
    for (const auto& p : reference->parameters()) {
      if (p.grad().defined()) squares += p.grad().to(at::kDouble).pow(2).sum().item<double>();
    }
    ref_norms.push_back(std::sqrt(squares));
    ref_opt.step();
    ref_losses.push_back(loss.item<double>());
  }

  for (const int ep : layouts(config.moe->num_experts)) {
    CausalLM model = seeded(config);
    const Split s = split(model, ep, /*wrap=*/true);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.5));
    const int64_t per_rank = kGlobalBatch / world;
    for (int step = 0; step < kSteps; ++step) {
      const at::Tensor local = batches[step].narrow(0, me * per_rank, per_rank);
      const at::Tensor loss = mdist::hf::causal_lm_loss(model->forward(local), local);
      opt.zero_grad();
      loss.backward();
      // The global gradient norm counts every expert's shard once (a bound that never clips).
      EXPECT_NEAR(mdist::hf::clip_grad_norm_(model, s.parallelism, 1e30), ref_norms[step],
                  1e-5 * ref_norms[step])
          << "ep " << ep << ", step " << step;
      opt.step();
      const double global = mdist::allreduce(loss.item<double>()) / world;
      EXPECT_NEAR(global, ref_losses[step], 1e-5 * ref_losses[step])
          << "ep " << ep << ", step " << step;
    }
    // This rank's experts, gathered over their FSDP group, against the same experts trained
    // in one process.
    for (std::size_t l = 0; l < model->model->decoder_layers.size(); ++l) {
      const auto& block = model->model->decoder_layers[l]->moe;
      if (!block) continue;
      auto handle = mdist::fsdp_handle(*block->experts);
      ASSERT_TRUE(handle.has_value());
      handle->unshard();
      const auto& ref_experts = reference->model->decoder_layers[l]->moe->experts;
      for (std::size_t i = 0; i < block->experts->local.size(); ++i) {
        const auto& mine = block->experts->local[i];
        const auto& same = ref_experts->local[block->experts->first + static_cast<int64_t>(i)];
        const at::Tensor got = mine->down_proj->weight, want = same->down_proj->weight;
        EXPECT_LT(((got - want).abs().max() / want.abs().max()).item<double>(), 1e-5)
            << "ep " << ep << ", layer " << l << ", expert " << block->experts->first + i;
      }
      handle->reshard();
    }
  }
}

// The all-to-all counters belong to the model's plan (one per block's style, summed by the
// plan), not to the process: two models split alike count their own traffic each, the same
// bytes for the same forward, and a reset clears one model's only.
TEST_P(ExpertParallel, CountsCommunicationPerModel) {
  const LlamaConfig config = fixture_config(GetParam(), 12);
  const int ep = mdist::size();
  if (ep == 1 || config.moe->num_experts % ep != 0) GTEST_SKIP() << "needs ep > 1";
  CausalLM first = seeded(config), second = seeded(config);
  const Split a = split(first, ep, /*wrap=*/false), b = split(second, ep, /*wrap=*/false);
  ASSERT_TRUE(a.parallelism.expert_parallel && b.parallelism.expert_parallel);
  torch::manual_seed(5);
  const at::Tensor ids = torch::randint(0, config.vocab_size, {2, 8});
  const at::NoGradGuard no_grad;
  first->forward(ids);
  const auto counted = a.parallelism.communication();
  // Two all-to-alls (there and back) per sparse layer.
  int64_t sparse = 0;
  for (const auto& layer : first->model->decoder_layers) sparse += layer->moe ? 1 : 0;
  EXPECT_EQ(counted.all_to_alls, 2 * sparse);
  EXPECT_EQ(b.parallelism.communication().all_to_alls, 0);
  second->forward(ids);
  EXPECT_EQ(b.parallelism.communication().all_to_all_bytes, counted.all_to_all_bytes);
  a.parallelism.reset_communication();
  EXPECT_EQ(a.parallelism.communication().all_to_all_bytes, 0);
  EXPECT_EQ(b.parallelism.communication().all_to_all_bytes, counted.all_to_all_bytes);
}

TEST_P(ExpertParallel, EachRankHoldsOnlyItsOwnExperts) {
  const LlamaConfig config = fixture_config(GetParam(), 12);
  const int ep = mdist::size();
  if (config.moe->num_experts % ep != 0) GTEST_SKIP() << "12 experts on " << ep << " ranks";
  CausalLM model = seeded(config);
  split(model, ep, /*wrap=*/false);
  const int64_t per_rank = config.moe->num_experts / ep;
  const int64_t first = mdist::rank() * per_rank;
  int64_t expert_params = 0;
  for (const auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    const auto at = name.find(".experts.");
    if (at == std::string::npos) continue;
    const int64_t index = std::stoll(name.substr(at + 9));
    EXPECT_GE(index, first) << name;
    EXPECT_LT(index, first + per_rank) << name;
    ++expert_params;
  }
  int64_t sparse_layers = 0;
  for (const auto& layer : model->model->decoder_layers) sparse_layers += layer->moe ? 1 : 0;
  EXPECT_EQ(expert_params, sparse_layers * per_rank * 3);  // gate, up and down per expert
}

// A checkpoint saved without expert parallelism, loaded by load_pretrained_fsdp2 in every
// (dp, ep) layout: each rank builds on the meta device, keeps and reads only its own experts,
// and the logits are the saved model's.
TEST_P(ExpertParallel, LoadPretrainedFsdp2ReadsOnlyItsExperts) {
  const LlamaConfig config = fixture_config(GetParam(), 12);
  CausalLM reference = seeded(config);
  const std::filesystem::path dir = temp_dir("mdist-ep-load-" + GetParam());
  if (mdist::is_master()) mdist::hf::save_pretrained(reference, dir);
  mdist::barrier();
  torch::manual_seed(3);
  const at::Tensor ids = torch::randint(0, config.vocab_size, {2, 8});
  at::Tensor expected;
  {
    const at::NoGradGuard no_grad;
    expected = reference->forward(ids);
  }
  for (const int ep : layouts(config.moe->num_experts)) {
    CausalLM loaded = load_in_layout(dir, ep);
    const int64_t first = mdist::rank() % ep * (config.moe->num_experts / ep);
    for (const auto& layer : loaded->model->decoder_layers) {
      if (!layer->moe) continue;
      EXPECT_EQ(layer->moe->experts->first, ep > 1 ? first : 0) << "ep " << ep;
      EXPECT_EQ(static_cast<int64_t>(layer->moe->experts->local.size()),
                config.moe->num_experts / ep);
    }
    const at::NoGradGuard no_grad;
    EXPECT_LT((loaded->forward(ids) - expected).abs().max().item<double>(), 1e-5) << "ep " << ep;
  }
  mdist::barrier();
  if (mdist::is_master()) std::filesystem::remove_all(dir);
}

// save_pretrained of a model whose experts are split, in every (dp, ep) layout, unwrapped and
// under FSDP, in fp32 and in bf16 with fp32 routers: rank 0 writes every expert, and the
// checkpoint is the unsplit model's, tensor for tensor bit for bit (and config.json byte for
// byte). It loads in one process (hf::load_pretrained) as the unsplit model, and under another
// (dp, ep) layout gives the unsplit model's logits.
TEST_P(ExpertParallel, SavePretrainedWritesEveryExpertAsTheUnsplitModel) {
  const LlamaConfig config = fixture_config(GetParam(), 12);
  const std::vector<int> eps = layouts(config.moe->num_experts);
  const std::filesystem::path base = temp_dir("mdist-ep-save-" + GetParam());
  torch::manual_seed(3);
  const at::Tensor ids = torch::randint(0, config.vocab_size, {2, 8});
  for (const bool bf16 : {false, true}) {
    const auto make = [&] {
      CausalLM model = seeded(config);
      if (bf16) {
        model->to(at::kBFloat16);
        for (auto& layer : model->model->decoder_layers) {
          if (layer->moe) layer->moe->gate->to(at::kFloat);
        }
      }
      return model;
    };
    CausalLM reference = make();
    const std::filesystem::path unsplit = base / (bf16 ? "unsplit-bf16" : "unsplit");
    if (mdist::is_master()) mdist::hf::save_pretrained(reference, unsplit);
    mdist::barrier();
    at::Tensor expected;
    {
      const at::NoGradGuard no_grad;
      expected = reference->forward(ids).to(at::kFloat);
    }
    for (std::size_t l = 0; l < eps.size(); ++l) {
      const int ep = eps[l];
      for (const bool wrap : {false, true}) {
        const std::string what =
            "ep " + std::to_string(ep) + (wrap ? " with FSDP" : "") + (bf16 ? " in bf16" : "");
        const std::filesystem::path dir =
            base / ("ep" + std::to_string(ep) + (wrap ? "-fsdp" : "") + (bf16 ? "-bf16" : ""));
        {
          CausalLM model = make();
          const Split s = split(model, ep, wrap);
          mdist::hf::save_pretrained(model, s.parallelism, dir);
        }
        mdist::barrier();
        if (mdist::is_master()) {
          EXPECT_EQ(file_text(dir / "config.json"), file_text(unsplit / "config.json")) << what;
          const auto got = saved_tensors(dir), want = saved_tensors(unsplit);
          EXPECT_EQ(keys_of(got), keys_of(want)) << what;
          for (const auto& [name, tensor] : want) {
            const auto it = got.find(name);
            if (it == got.end()) continue;
            EXPECT_TRUE(same_bits(it->second, tensor)) << what << ": " << name;
          }
          // One process loads it as the unsplit model (built in fp32: bf16 values convert
          // exactly).
          CausalLM loaded = mdist::hf::load_pretrained(dir);
          const auto params = reference->named_parameters();
          for (const auto& item : loaded->named_parameters()) {
            const at::Tensor value = item.value().detach();
            EXPECT_TRUE(same_bits(value, params[item.key()].detach().to(value.scalar_type())))
                << what << ": loaded " << item.key();
          }
        }
        // Another (dp, ep) layout loads it (fp32 only: load_pretrained_fsdp2 builds the
        // config's dtype) and gives the unsplit model's logits.
        if (!bf16) {
          const int other = eps[(l + 1) % eps.size()];
          CausalLM loaded = load_in_layout(dir, other);
          const at::NoGradGuard no_grad;
          EXPECT_LT((loaded->forward(ids) - expected).abs().max().item<double>(), 1e-5)
              << what << ", loaded with ep " << other;
        }
        mdist::barrier();
        if (mdist::is_master()) std::filesystem::remove_all(dir);
      }
    }
  }
  mdist::barrier();
  if (mdist::is_master()) std::filesystem::remove_all(base);
}

TEST_P(ExpertParallel, BadInput) {
  CausalLM dense(
      LlamaConfig::from_file(std::string(MDIST_HF_MODEL_FIXTURES) + "/llama/config.json"));
  EXPECT_THAT(mdist::testing::error_of(
                  [&] { mdist::hf::parallelize_experts(dense, mdist::Group::world()); }),
              HasSubstr("has no mixture-of-experts layer"));
  const int world = mdist::size();
  if (world > 1) {
    CausalLM odd = seeded(fixture_config(GetParam(), world + 1));
    EXPECT_THAT(mdist::testing::error_of(
                    [&] { mdist::hf::parallelize_experts(odd, mdist::Group::world()); }),
                HasSubstr(std::to_string(world + 1) +
                          " experts do not divide over an expert-parallel group of " +
                          std::to_string(world) + " ranks"));
  }
  CausalLM wrapped = seeded(fixture_config(GetParam(), 12));
  mdist::fsdp2_wrap(*wrapped);
  EXPECT_THAT(mdist::testing::error_of(
                  [&] { mdist::hf::parallelize_experts(wrapped, mdist::Group::world()); }),
              HasSubstr("already wrapped by fully_shard"));
}

INSTANTIATE_TEST_SUITE_P(Architectures, ExpertParallel,
                         ::testing::Values("qwen3_moe", "mixtral", "qwen2_moe"));

}  // namespace
