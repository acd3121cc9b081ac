// Activation checkpointing under FSDP2 (fsdp2_wrap) on 1-4 ranks: five steps of a tiny Llama
// give bit-identical losses, shard gradients and shards with and without checkpointing of its
// decoder layers (fp32, and bf16 compute), each unit reduce-scatters exactly once per
// backward (a double or a missed reduce-scatter changes the count) and gathers as often as
// without checkpointing (the recompute's gather replaces the pre-backward's).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/hf/activation_checkpointing.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/mdist.h"

namespace {

constexpr int kSteps = 5;

struct Steps {
  std::vector<at::Tensor> losses;
  std::map<std::string, at::Tensor> grads, weights;
  std::vector<mdist::FsdpCommStats> comm;  // per unit: the decoder layers, then the root
};

Steps train(bool checkpointed, const std::optional<mdist::MixedPrecisionPolicy>& mp) {
  const auto config = mdist::hf::LlamaConfig::from_file(std::string(MDIST_HF_MODEL_FIXTURES) +
                                                        "/llama/config.json");
  torch::manual_seed(17);
  mdist::hf::CausalLM model(config);
  if (checkpointed) {
    mdist::hf::apply_activation_checkpointing(
        model, {.mode = mdist::hf::ActivationCheckpointingMode::kFull});
  }
  const auto units = mdist::fsdp2_wrap(*model, /*shard_root=*/true, mp);
  std::vector<mdist::FsdpHandle> handles;
  for (const auto& unit : units) handles.push_back(*mdist::fsdp_handle(*unit));
  handles.push_back(*mdist::fsdp_handle(*model));
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  Steps run;
  const int rank = mdist::rank();
  for (int step = 0; step < kSteps; ++step) {
    torch::manual_seed(300 + 31 * step + rank);  // each rank its own batch
    const at::Tensor ids = torch::randint(1, config.vocab_size, {2, 12});
    optimizer.zero_grad();
    const at::Tensor loss = mdist::hf::causal_lm_loss(model->forward(ids), ids);
    loss.backward();
    run.losses.push_back(loss.detach().clone());
    for (const auto& p : model->named_parameters()) {
      EXPECT_TRUE(p.value().grad().defined()) << p.key();
      if (!p.value().grad().defined()) continue;
      run.grads[p.key() + "@" + std::to_string(step)] = p.value().grad().clone();
    }
    optimizer.step();
  }
  for (const auto& p : model->named_parameters()) run.weights[p.key()] = p.value().detach().clone();
  for (const auto& handle : handles) run.comm.push_back(handle.communication());
  return run;
}

void expect_identical(const Steps& got, const Steps& expected) {
  ASSERT_EQ(got.losses.size(), expected.losses.size());
  for (std::size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_TRUE(torch::equal(got.losses[i], expected.losses[i])) << "loss of step " << i;
  }
  ASSERT_EQ(got.grads.size(), expected.grads.size());
  for (const auto& [name, grad] : expected.grads) {
    EXPECT_TRUE(torch::equal(got.grads.at(name), grad)) << name;
  }
  for (const auto& [name, weight] : expected.weights) {
    EXPECT_TRUE(torch::equal(got.weights.at(name), weight)) << name;
  }
}

void expect_communication(const Steps& got, const Steps& expected) {
  ASSERT_EQ(got.comm.size(), expected.comm.size());
  const bool communicates = mdist::size() > 1;  // one rank communicates nothing
  for (std::size_t u = 0; u < got.comm.size(); ++u) {
    SCOPED_TRACE("unit " + std::to_string(u));
    EXPECT_EQ(got.comm[u].reduce_scatters, communicates ? kSteps : 0);
    EXPECT_EQ(got.comm[u].reduce_scatters, expected.comm[u].reduce_scatters);
    EXPECT_EQ(got.comm[u].all_gathers, expected.comm[u].all_gathers);
    EXPECT_EQ(got.comm[u].reduce_scatter_bytes, expected.comm[u].reduce_scatter_bytes);
  }
}

TEST(CheckpointFsdp, Fp32IsBitIdenticalAndReducesOncePerUnit) {
  const Steps reference = train(false, std::nullopt);
  const Steps checkpointed = train(true, std::nullopt);
  expect_identical(checkpointed, reference);
  expect_communication(checkpointed, reference);
}

TEST(CheckpointFsdp, Bf16ComputeIsBitIdentical) {
  mdist::MixedPrecisionPolicy mp;
  mp.param_dtype = at::kBFloat16;
  mp.reduce_dtype = at::kFloat;
  const Steps reference = train(false, mp);
  const Steps checkpointed = train(true, mp);
  expect_identical(checkpointed, reference);
  expect_communication(checkpointed, reference);
}

}  // namespace
