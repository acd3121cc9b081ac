// mdist::nn::checkpoint on one process: a run with checkpointing gives bit-identical losses,
// gradients and weights (fp32, torch::equal) to the run without, for a plain module with
// dropout (the RNG replay) and for hf::CausalLM (full and selective); and the recompute does
// run (the function is called again in backward).
#include "mdist/nn/checkpoint.h"

#include <gtest/gtest.h>

#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "mdist/hf/activation_checkpointing.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/nn/hooks.h"

namespace {

// Two blocks, each linear -> gelu -> dropout -> linear with a residual; block 1 optionally
// under checkpoint.
struct BlocksImpl : torch::nn::Module {
  BlocksImpl() {
    for (int i = 0; i < 2; ++i) {
      in.push_back(register_module("in" + std::to_string(i), torch::nn::Linear(6, 12)));
      out.push_back(register_module("out" + std::to_string(i), torch::nn::Linear(12, 6)));
    }
    dropout = register_module("dropout", torch::nn::Dropout(0.3));
  }
  at::Tensor block(std::size_t i, const at::Tensor& x) {
    return x + out[i](dropout(torch::gelu(in[i](x))));
  }
  at::Tensor forward(const at::Tensor& x, bool checkpointed, bool preserve_rng = true) {
    at::Tensor h = block(0, x);
    if (!checkpointed) return block(1, h);
    const auto outputs = mdist::nn::checkpoint(
        [this](const std::vector<at::Tensor>& inputs) {
          ++calls;
          return std::vector<at::Tensor>{block(1, inputs[0])};
        },
        {h}, {.module = this, .preserve_rng_state = preserve_rng});
    return outputs[0];
  }
  std::vector<torch::nn::Linear> in, out;
  torch::nn::Dropout dropout{nullptr};
  int calls = 0;
};
TORCH_MODULE(Blocks);

struct Trace {
  std::vector<at::Tensor> losses;
  std::map<std::string, at::Tensor> grads, weights;
};

// Five AdamW steps of `loss_of` on `module`, recording what must match.
Trace train(torch::nn::Module& module, const std::function<at::Tensor(int)>& loss_of) {
  torch::optim::AdamW optimizer(module.parameters(), torch::optim::AdamWOptions(1e-2));
  Trace trace;
  for (int step = 0; step < 5; ++step) {
    optimizer.zero_grad();
    const at::Tensor loss = loss_of(step);
    loss.backward();
    trace.losses.push_back(loss.detach().clone());
    for (const auto& p : module.named_parameters()) {
      if (p.value().grad().defined())
        trace.grads[p.key() + "@" + std::to_string(step)] = p.value().grad().clone();
    }
    optimizer.step();
  }
  for (const auto& p : module.named_parameters())
    trace.weights[p.key()] = p.value().detach().clone();
  return trace;
}

void expect_identical(const Trace& got, const Trace& expected) {
  ASSERT_EQ(got.losses.size(), expected.losses.size());
  for (std::size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_TRUE(torch::equal(got.losses[i], expected.losses[i]))
        << "step " << i << ": " << got.losses[i].item<double>() << " vs "
        << expected.losses[i].item<double>();
  }
  ASSERT_EQ(got.grads.size(), expected.grads.size());
  for (const auto& [name, grad] : expected.grads) {
    ASSERT_TRUE(got.grads.contains(name)) << name;
    EXPECT_TRUE(torch::equal(got.grads.at(name), grad)) << name;
  }
  ASSERT_EQ(got.weights.size(), expected.weights.size());
  for (const auto& [name, weight] : expected.weights) {
    EXPECT_TRUE(torch::equal(got.weights.at(name), weight)) << name;
  }
}

Trace train_blocks(bool checkpointed, bool preserve_rng, int* calls = nullptr) {
  torch::manual_seed(5);
  Blocks model;
  Trace trace = train(*model, [&](int step) {
    torch::manual_seed(100 + step);
    const at::Tensor x = torch::randn({4, 6});
    return model->forward(x, checkpointed, preserve_rng).pow(2).mean();
  });
  if (calls) *calls = model->calls;
  return trace;
}

TEST(Checkpoint, PlainModuleWithDropoutIsBitIdentical) {
  const Trace reference = train_blocks(false, true);
  int calls = 0;
  const Trace checkpointed = train_blocks(true, true, &calls);
  EXPECT_EQ(calls, 10);  // forward and recompute, five steps
  expect_identical(checkpointed, reference);
}

// Without the RNG replay the recompute draws another dropout mask: the gradients differ, so
// the test above does see the replay.
TEST(Checkpoint, WithoutRngReplayDropoutDiffers) {
  const Trace reference = train_blocks(false, true);
  const Trace checkpointed = train_blocks(true, false);
  EXPECT_FALSE(
      torch::equal(checkpointed.weights.at("in1.weight"), reference.weights.at("in1.weight")));
}

TEST(Checkpoint, NoGradIsAPlainCall) {
  int calls = 0;
  const torch::NoGradGuard no_grad;
  const at::Tensor x = torch::randn({2, 2}, torch::requires_grad());
  const auto y = mdist::nn::checkpoint(
      [&](const std::vector<at::Tensor>& in) {
        ++calls;
        return std::vector<at::Tensor>{in[0] * 2};
      },
      {x});
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(y[0].requires_grad());
}

TEST(Checkpoint, AnInputChangedInPlaceBeforeBackwardIsAnError) {
  const at::Tensor w = torch::randn({3}, torch::requires_grad());
  at::Tensor z = w * 1;
  const auto checkpointed = mdist::nn::checkpoint(
      [](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{in[0].sin()}; }, {z});
  z.add_(1);
  EXPECT_ANY_THROW(checkpointed[0].sum().backward());
}

// A frozen first input (token embeddings frozen): the layer's parameters still get gradients.
TEST(Checkpoint, ParametersGetGradientsWhenNoInputRequiresGrad) {
  torch::manual_seed(1);
  torch::nn::Linear reference(4, 3), linear(4, 3);
  linear->weight.set_data(reference->weight.detach().clone());
  linear->bias.set_data(reference->bias.detach().clone());
  const at::Tensor x = torch::randn({2, 4});
  reference(x).pow(2).sum().backward();
  const auto out = mdist::nn::checkpoint(
      [&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{linear(in[0])}; },
      {x}, {.module = linear.get()});
  out[0].pow(2).sum().backward();
  EXPECT_TRUE(torch::equal(linear->weight.grad(), reference->weight.grad()));
  EXPECT_TRUE(torch::equal(linear->bias.grad(), reference->bias.grad()));
}

mdist::hf::LlamaConfig tiny_config(bool moe) {
  return mdist::hf::LlamaConfig::from_file(std::string(MDIST_HF_MODEL_FIXTURES) +
                                           (moe ? "/qwen3_moe" : "/llama") + "/config.json");
}

Trace train_lm(bool moe, const mdist::hf::ActivationCheckpointing& ac) {
  torch::manual_seed(9);
  mdist::hf::CausalLM model(tiny_config(moe));
  mdist::hf::apply_activation_checkpointing(model, ac);
  return train(*model, [&](int step) {
    torch::manual_seed(200 + step);
    const at::Tensor ids = torch::randint(0, model->config.vocab_size, {2, 10});
    const at::Tensor loss = mdist::hf::causal_lm_loss(model->forward(ids), ids);
    return moe ? loss + 0.01 * model->aux_loss() : loss;
  });
}

TEST(Checkpoint, CausalLmFullAndSelectiveAreBitIdentical) {
  using Mode = mdist::hf::ActivationCheckpointingMode;
  for (const bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "qwen3_moe" : "llama");
    const Trace reference = train_lm(moe, {});
    expect_identical(train_lm(moe, {.mode = Mode::kFull}), reference);
    expect_identical(train_lm(moe, {.mode = Mode::kSelective, .every = 2}), reference);
  }
}

TEST(Checkpoint, SelectiveCountsLayersAsTorchtitan) {
  using Mode = mdist::hf::ActivationCheckpointingMode;
  mdist::hf::CausalLM model(tiny_config(false));
  EXPECT_EQ(
      mdist::hf::apply_activation_checkpointing(model, {.mode = Mode::kSelective, .every = 2}),
      (std::vector<std::int64_t>{1}));
  EXPECT_EQ(
      mdist::hf::apply_activation_checkpointing(model, {.mode = Mode::kSelective, .every = 1}),
      (std::vector<std::int64_t>{0, 1}));
  EXPECT_EQ(mdist::hf::apply_activation_checkpointing(model, {.mode = Mode::kFull}),
            (std::vector<std::int64_t>{0, 1}));
  EXPECT_TRUE(
      mdist::hf::apply_activation_checkpointing(model, {.mode = Mode::kSelective, .every = 3})
          .empty());
  EXPECT_TRUE(mdist::hf::apply_activation_checkpointing(model, {}).empty());
}

}  // namespace
