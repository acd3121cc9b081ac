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
                         ::testing::Values("llama", "mistral", "qwen2", "qwen3"));

}  // namespace
