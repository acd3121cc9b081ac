// fsdp2_wrap on the Hugging Face causal LM (each fixture architecture's config, seeded
// weights): wrapped on 1-4 ranks, the logits, the loss and the next step's loss equal the
// unwrapped model's.
#include <gtest/gtest.h>

#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/hf/pretrained.h"
#include "mdist/mdist.h"

namespace {

class HfFsdp2Wrap : public ::testing::TestWithParam<std::string> {};

mdist::hf::CausalLM seeded(const mdist::hf::LlamaConfig& config) {
  torch::manual_seed(17);
  return mdist::hf::CausalLM(config);
}

TEST_P(HfFsdp2Wrap, SameLogitsAndLossAsUnwrapped) {
  const auto config = mdist::hf::LlamaConfig::from_file(std::string(MDIST_HF_MODEL_FIXTURES) + "/" +
                                                        GetParam() + "/config.json");
  auto reference = seeded(config);
  auto wrapped = seeded(config);
  const auto layers = mdist::fsdp2_wrap(*wrapped);
  EXPECT_EQ(static_cast<int64_t>(layers.size()), config.num_hidden_layers);
  EXPECT_TRUE(mdist::is_fsdp2_model(*wrapped));

  // Every rank runs the same batch here: the wrapped model's sharding must not change what
  // one forward computes.
  torch::manual_seed(3);
  const at::Tensor ids = torch::randint(0, config.vocab_size, {2, 8});
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::AdamW opt(wrapped->parameters(), torch::optim::AdamWOptions(1e-3));
  for (int step = 0; step < 2; ++step) {
    const at::Tensor ref_logits = reference->forward(ids);
    const at::Tensor ref_loss = mdist::hf::causal_lm_loss(ref_logits, ids);
    const at::Tensor logits = wrapped->forward(ids);
    const at::Tensor loss = mdist::hf::causal_lm_loss(logits, ids);
    EXPECT_LT((logits - ref_logits).abs().max().item<double>(), 1e-5) << "step " << step;
    EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-6 * ref_loss.item<double>());
    ref_opt.zero_grad();
    ref_loss.backward();
    ref_opt.step();
    opt.zero_grad();
    loss.backward();  // gradients averaged over identical batches: the same update
    opt.step();
  }
}

// save_pretrained from a sharded model (gathered, written by rank 0; single file and sharded
// with an index), then load_pretrained on every rank gives the same logits.
TEST_P(HfFsdp2Wrap, SavePretrainedThenLoadGivesTheSameModel) {
  const auto config = mdist::hf::LlamaConfig::from_file(std::string(MDIST_HF_MODEL_FIXTURES) + "/" +
                                                        GetParam() + "/config.json");
  auto wrapped = seeded(config);
  mdist::fsdp2_wrap(*wrapped);
  const std::string base =
      mdist::broadcast((std::filesystem::temp_directory_path() /
                        ("mdist-save-" + std::to_string(::getpid()) + "-" + GetParam()))
                           .string());
  torch::manual_seed(5);
  const at::Tensor ids = torch::randint(0, config.vocab_size, {2, 8});
  at::Tensor expected;
  {
    const at::NoGradGuard no_grad;
    expected = wrapped->forward(ids);
  }
  for (const std::uint64_t shard_bytes : {std::uint64_t{1} << 30, std::uint64_t{16} << 10}) {
    const std::filesystem::path dir = base + "-" + std::to_string(shard_bytes);
    mdist::hf::save_pretrained(wrapped, dir, shard_bytes);
    mdist::barrier();
    const bool sharded = std::filesystem::exists(dir / "model.safetensors.index.json");
    EXPECT_EQ(sharded, shard_bytes < (std::uint64_t{1} << 30)) << dir;
    EXPECT_TRUE(std::filesystem::exists(dir / "config.json"));
    auto loaded = mdist::hf::load_pretrained(dir);
    // And into a model sharded first, each rank reading only its rows.
    torch::manual_seed(99);
    mdist::hf::CausalLM resharded(config);
    mdist::fsdp2_wrap(*resharded);
    mdist::hf::load_checkpoint_sharded(*resharded, dir);
    const at::NoGradGuard no_grad;
    EXPECT_LT((loaded->forward(ids) - expected).abs().max().item<double>(), 1e-6);
    EXPECT_LT((resharded->forward(ids) - expected).abs().max().item<double>(), 1e-6);
    mdist::barrier();
    if (mdist::is_master()) std::filesystem::remove_all(dir);
  }
}

INSTANTIATE_TEST_SUITE_P(Architectures, HfFsdp2Wrap,
                         ::testing::Values("llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
                                           "qwen2_moe", "mixtral"));

// A bf16 mixture of experts whose routers stay fp32: fsdp2_wrap keeps each router whole and
// replicated on the compute device (warning once, on rank 0), shards the rest, averages the
// routers' gradients over the ranks, and trains on loss + coef * aux loss as the unwrapped
// model on one rank does.
TEST(HfFsdp2WrapMoe, Bfloat16ModelKeepsFloat32RoutersWholeAndAveragesTheirGradients) {
  const auto config = mdist::hf::LlamaConfig::from_file(std::string(MDIST_HF_MODEL_FIXTURES) +
                                                        "/qwen3_moe/config.json");
  const auto make = [&] {
    auto model = seeded(config);
    model->to(at::kBFloat16);
    for (auto& layer : model->model->decoder_layers) {
      if (layer->moe) layer->moe->gate->to(at::kFloat);
    }
    return model;
  };
  auto reference = make();
  auto wrapped = make();
  ::testing::internal::CaptureStderr();
  mdist::fsdp2_wrap(*wrapped);
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  const std::string expected_warning =
      "mdist: fsdp2_wrap: 1 parameter(s) differ from the model's bfloat16 and stay replicated "
      "and unsharded: model.layers.0.mlp.gate.weight (float32) (";
  if (mdist::is_master()) {
    EXPECT_NE(warnings.find(expected_warning), std::string::npos) << warnings;
    EXPECT_EQ(warnings.find(expected_warning), warnings.rfind(expected_warning)) << warnings;
  } else {
    EXPECT_EQ(warnings.find("fsdp2_wrap"), std::string::npos) << warnings;
  }
  const auto& router = wrapped->model->decoder_layers[0]->moe->gate->weight;
  EXPECT_EQ(router.scalar_type(), at::kFloat);
  EXPECT_EQ(router.sizes(), reference->model->decoder_layers[0]->moe->gate->weight.sizes());
  EXPECT_EQ(router.device(), mdist::compute_device());

  const auto loss_of = [&](mdist::hf::CausalLM& model, const at::Tensor& ids) {
    const at::Tensor loss = mdist::hf::causal_lm_loss(model->forward(ids), ids);
    return loss + config.moe->router_aux_loss_coef * model->aux_loss();
  };
  const int world = mdist::size(), me = mdist::rank();
  // Each rank its own batch: the router's gradient is the mean of the ranks' gradients.
  torch::manual_seed(11);
  std::vector<at::Tensor> batches;
  for (int r = 0; r < world; ++r) batches.push_back(torch::randint(0, config.vocab_size, {2, 8}));
  at::Tensor mean_grad;
  for (int r = 0; r < world; ++r) {
    reference->zero_grad();
    loss_of(reference, batches[static_cast<std::size_t>(r)]).backward();
    const at::Tensor g = reference->model->decoder_layers[0]->moe->gate->weight.grad().clone();
    mean_grad = r == 0 ? g / world : mean_grad + g / world;
  }
  wrapped->zero_grad();
  loss_of(wrapped, batches[static_cast<std::size_t>(me)]).backward();
  ASSERT_TRUE(router.grad().defined());
  EXPECT_EQ(router.grad().scalar_type(), at::kFloat);
  EXPECT_LT((router.grad().cpu() - mean_grad).abs().max().item<double>(),
            1e-5 * std::max(1.0, mean_grad.abs().max().item<double>()));

  // Every rank the same batch: the wrapped run's losses are the unwrapped one-rank run's.
  // Gradients reduce in fp32: a bf16 mean of three equal bf16 values need not be that value
  // (3x rounds), which would move the weights of a 3-rank run by an ulp.
  reference = make();
  wrapped = make();
  ::testing::internal::CaptureStderr();
  mdist::MixedPrecisionPolicy reduce_in_fp32;
  reduce_in_fp32.reduce_dtype = at::kFloat;
  mdist::fsdp2_wrap(*wrapped, true, reduce_in_fp32);
  (void)::testing::internal::GetCapturedStderr();
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt(wrapped->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    const at::Tensor ref_loss = loss_of(reference, batches[0]);
    const at::Tensor loss = loss_of(wrapped, batches[0]);
    EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-5) << "step " << step;
    ref_opt.zero_grad();
    ref_loss.backward();
    ref_opt.step();
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
}

}  // namespace
