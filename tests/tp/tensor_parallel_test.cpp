// Tensor parallelism against the unsplit computation, on 1-4 ranks through mdistrun: the
// collectives and layers (outputs and every gradient), vocab-parallel cross entropy, the
// Llama family split by hf::parallelize (each fixture architecture's config, biases, a tied
// head, KV heads replicated when fewer than the ranks), and TP x FSDP2 training, saving and
// loading on every (dp, tp) layout the world allows, each against a single-process reference
// run on every rank.
#include <gtest/gtest.h>

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/hf/parallelize.h"
#include "mdist/hf/pretrained.h"
#include "mdist/hf/safetensors.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/mdist.h"

namespace {

using mdist::hf::CausalLM;
using mdist::hf::LlamaConfig;
using Split = mdist::hf::TensorParallelPlacement::Split;

std::vector<int> tp_sizes() {  // every tensor-parallel size > 1 the world divides by
  std::vector<int> sizes;
  for (int t = 2; t <= mdist::size(); ++t) {
    if (mdist::size() % t == 0) sizes.push_back(t);
  }
  return sizes;
}

LlamaConfig fixture(const std::string& name) {
  return LlamaConfig::from_file(std::string(MDIST_HF_MODEL_FIXTURES) + "/" + name + "/config.json");
}

// A small Llama config in code: `heads` query heads of 8 dims, `kv` KV heads.
LlamaConfig small(int64_t heads, int64_t kv, int64_t vocab = 48) {
  LlamaConfig c = fixture("llama");
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv;
  c.head_dim = 8;
  c.hidden_size = 8 * heads;
  c.intermediate_size = 24 * 4;
  c.vocab_size = vocab;
  return c;
}

CausalLM seeded(const LlamaConfig& config) {
  torch::manual_seed(17);
  return CausalLM(config);
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// The part of a full (reference) tensor that `placement` says this rank holds.
at::Tensor local_part(const at::Tensor& full, const mdist::hf::TensorParallelPlacement& p) {
  return p.local_part(full);
}

// Whether hf::parallelize splits `config` over t ranks: whole query heads per rank, and for
// Phi-3's fused qkv_proj and OLMo 2's full-width k norm whole KV heads (no shared ones).
bool splits(const LlamaConfig& config, int t) {
  const bool whole_kv = config.num_key_value_heads % t == 0;
  return config.num_attention_heads % t == 0 &&
         (whole_kv || !(config.fused_projections || config.qk_norm_full_width));
}

// ---- collectives and layers ----

TEST(TpLayers, ColumnAndRowParallelLinearsMatchTheUnsplitPair) {
  const mdist::Group world;
  const int t = mdist::size(), r = mdist::rank();
  torch::manual_seed(1);
  torch::nn::Linear fc1(torch::nn::LinearOptions(6, 4 * t).bias(true));
  torch::nn::Linear fc2(torch::nn::LinearOptions(4 * t, 5).bias(true));
  const at::Tensor x = torch::randn({3, 6}, torch::requires_grad());
  const at::Tensor probe = torch::randn({3, 5});
  (fc2(torch::relu(fc1(x))) * probe).sum().backward();

  torch::manual_seed(1);
  torch::nn::Linear tp1(torch::nn::LinearOptions(6, 4 * t).bias(true));
  torch::nn::Linear tp2(torch::nn::LinearOptions(4 * t, 5).bias(true));
  mdist::tp::parallelize_column(*tp1, world);
  mdist::tp::parallelize_row(*tp2, world);
  EXPECT_EQ(tp1->weight.sizes(), (std::vector<int64_t>{4, 6}));
  EXPECT_EQ(tp2->weight.sizes(), (std::vector<int64_t>{5, 4}));
  const at::Tensor x2 = x.detach().clone().requires_grad_(true);
  const at::Tensor out = mdist::nn::call(tp2, torch::relu(mdist::nn::call(tp1, x2)));
  EXPECT_LT(max_diff(out, fc2(torch::relu(fc1(x)))), 1e-6);
  (out * probe).sum().backward();
  EXPECT_LT(max_diff(x2.grad(), x.grad()), 1e-6);
  EXPECT_LT(max_diff(tp1->weight.grad(), fc1->weight.grad().narrow(0, 4 * r, 4)), 1e-6);
  EXPECT_LT(max_diff(tp1->bias.grad(), fc1->bias.grad().narrow(0, 4 * r, 4)), 1e-6);
  EXPECT_LT(max_diff(tp2->weight.grad(), fc2->weight.grad().narrow(1, 4 * r, 4)), 1e-6);
  // The row-parallel bias is added once, after the reduction, and its gradient is whole.
  EXPECT_LT(max_diff(tp2->bias.grad(), fc2->bias.grad()), 1e-6);
  EXPECT_TRUE(tp2->bias.defined());
}

TEST(TpLayers, GatheredColumnOutputAndScatterAreInverse) {
  const mdist::Group world;
  const int t = mdist::size(), r = mdist::rank();
  torch::manual_seed(2);
  torch::nn::Linear full(torch::nn::LinearOptions(5, 3 * t));
  const at::Tensor x = torch::randn({2, 5});
  const at::Tensor probe = torch::randn({2, 3 * t});
  torch::manual_seed(2);
  torch::nn::Linear split(torch::nn::LinearOptions(5, 3 * t));
  mdist::tp::parallelize_column(*split, world, {.gather_output = true});
  const at::Tensor out = mdist::nn::call(split, x);
  EXPECT_LT(max_diff(out, full(x)), 1e-6);
  (out * probe).sum().backward();
  (full(x) * probe).sum().backward();
  EXPECT_LT(max_diff(split->weight.grad(), full->weight.grad().narrow(0, 3 * r, 3)), 1e-6);

  const at::Tensor whole = torch::randn({2, 2 * t}, torch::requires_grad());
  const at::Tensor part = mdist::tp::scatter_to_group(whole, world, 1);
  EXPECT_TRUE(part.equal(whole.detach().narrow(1, 2 * r, 2)));
  mdist::tp::gather_from_group(part, world, 1).sum().backward();
  EXPECT_TRUE(whole.grad().equal(torch::ones({2, 2 * t})));  // every rank's part of d(sum)
  if (t > 1) {
    EXPECT_THROW(mdist::tp::scatter_to_group(torch::zeros({2, 2 * t + 1}), world, 1), mdist::Error);
  }
}

TEST(TpLayers, VocabParallelEmbeddingMatchesTheTableAndRefusesBadIds) {
  const mdist::Group world;
  const int t = mdist::size(), r = mdist::rank();
  const int64_t vocab = 6 * t;
  torch::manual_seed(3);
  torch::nn::Embedding full(torch::nn::EmbeddingOptions(vocab, 4).padding_idx(vocab - 1));
  torch::manual_seed(3);
  torch::nn::Embedding split(torch::nn::EmbeddingOptions(vocab, 4).padding_idx(vocab - 1));
  mdist::tp::parallelize_vocab_embedding(*split, world);
  const at::Tensor ids =
      torch::tensor({int64_t{0}, vocab - 1, 7 % vocab, vocab / 2, int64_t{1}, vocab - 1})
          .view({2, 3});
  const at::Tensor probe = torch::randn({2, 3, 4});
  const at::Tensor out = mdist::nn::call(split, ids);
  EXPECT_LT(max_diff(out, full(ids)), 1e-7);
  (out * probe).sum().backward();
  (full(ids) * probe).sum().backward();
  EXPECT_LT(max_diff(split->weight.grad(), full->weight.grad().narrow(0, 6 * r, 6)), 1e-7);
  EXPECT_TRUE(full->weight.grad()[vocab - 1].abs().sum().item<double>() == 0);  // padding
  try {
    mdist::nn::call(split, torch::tensor({int64_t{0}, vocab}).view({1, 2}));
    FAIL() << "an id past the vocabulary was accepted";
  } catch (const mdist::Error& error) {
    EXPECT_NE(std::string(error.what()).find("out of range"), std::string::npos) << error.what();
  }
}

TEST(TpLayers, StandaloneModulesComputeTheSplitLayers) {
  const mdist::Group world;
  const int t = mdist::size(), r = mdist::rank();
  mdist::tp::ColumnParallelLinear col(5, 2 * t, world, true, false);
  mdist::tp::RowParallelLinear row(2 * t, 3, world, true, true);
  mdist::tp::VocabParallelEmbedding emb(4 * t, 5, world);
  // The full layers are every rank's parts, gathered.
  const auto gather0 = [&](const at::Tensor& part) {
    return mdist::tp::gather_from_group(part.detach(), world, 0);
  };
  const at::Tensor w1 = gather0(col->weight), b1 = gather0(col->bias);
  const at::Tensor w2 = gather0(row->weight.t().contiguous()).t();
  const at::Tensor table = gather0(emb->weight);
  // Replicated parts (the row-parallel bias) must agree for the test's reference: use rank 0's.
  at::Tensor b2 = row->bias.detach().clone();
  mdist::tp::all_reduce_(b2, world, "sum");
  b2 /= t;
  {
    const at::NoGradGuard no_grad;
    row->bias.copy_(b2);
  }
  const at::Tensor ids = torch::tensor({int64_t{1}, int64_t{4} * t - 1}).view({1, 2});
  const at::Tensor h = emb(ids);
  EXPECT_LT(max_diff(h, at::embedding(table, ids)), 1e-7);
  const at::Tensor out = row(col(h));
  EXPECT_LT(max_diff(out, at::linear(at::linear(h, w1, b1), w2, b2)), 1e-5);
  EXPECT_EQ(col->weight.size(0), 2);
  (void)r;
}

TEST(TpCrossEntropy, MatchesTorchOnTheGatheredLogitsWithIgnoredLabels) {
  const mdist::Group world;
  const int t = mdist::size(), r = mdist::rank();
  const int64_t vocab = 5 * t;
  torch::manual_seed(4);
  const at::Tensor logits = (torch::randn({7, vocab}) * 4).requires_grad_(true);
  const at::Tensor labels = torch::randint(0, vocab, {7});
  labels[2] = -100;
  const at::Tensor expected = at::cross_entropy_loss(logits, labels, {}, at::Reduction::Mean, -100);
  expected.backward();
  const at::Tensor part = logits.detach().narrow(1, 5 * r, 5).clone().requires_grad_(true);
  const at::Tensor loss = mdist::tp::vocab_parallel_cross_entropy(part, labels, world, 5 * r);
  EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-6);
  (loss * 3).backward();
  EXPECT_LT(max_diff(part.grad(), 3 * logits.grad().narrow(1, 5 * r, 5)), 1e-6);

  // Every label ignored: NaN, as torch's mean gives.
  const at::Tensor none = torch::full({7}, -100, torch::kLong);
  EXPECT_TRUE(std::isnan(
      mdist::tp::vocab_parallel_cross_entropy(part.detach(), none, world, 5 * r).item<double>()));
  EXPECT_THROW(
      mdist::tp::vocab_parallel_cross_entropy(part.detach(), torch::full({7}, vocab), world, 5 * r),
      mdist::Error);
}

// ---- the Llama family under tensor parallelism ----

// Logits, loss and every gradient of the model split over T ranks equal the unsplit model's
// (gradients: this rank's part of the reference gradient).
void expect_split_matches(const LlamaConfig& config, int t, const std::string& label) {
  CausalLM reference = seeded(config);
  CausalLM split = seeded(config);
  const auto state = mdist::make_parallel_state({.tensor_parallel = t});
  const auto plan = mdist::hf::parallelize(split, state);
  ASSERT_EQ(plan->size(), t);
  torch::manual_seed(5);
  const at::Tensor ids = torch::randint(0, config.vocab_size, {2, 9});
  const at::Tensor ref_logits = reference->forward(ids);
  const at::Tensor ref_loss = mdist::hf::causal_lm_loss(ref_logits, ids);
  ref_loss.backward();
  const at::Tensor logits = split->forward(ids);
  EXPECT_EQ(logits.size(2), config.vocab_size / t) << label;
  // 1e-5 relative to the logits' scale: the split sums in another order.
  const double scale = std::max(1.0, ref_logits.abs().max().item<double>());
  EXPECT_LT(max_diff(plan->full_logits(logits), ref_logits), 1e-5 * scale) << label;
  const at::Tensor loss = plan->loss(logits, ids);
  EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-5 * ref_loss.item<double>())
      << label;
  loss.backward();
  const auto ref_params = reference->named_parameters();
  for (const auto& item : split->named_parameters()) {
    const auto p = plan->placement(item.key());
    const at::Tensor expected = local_part(ref_params[item.key()].grad(), p);
    ASSERT_TRUE(item.value().grad().defined()) << label << " " << item.key();
    ASSERT_EQ(item.value().sizes(), expected.sizes()) << label << " " << item.key();
    EXPECT_LT(max_diff(item.value().grad(), expected), 1e-5) << label << " " << item.key();
  }
}

class TpArchitectures : public ::testing::TestWithParam<std::string> {};

TEST_P(TpArchitectures, SplitModelEqualsUnsplitInLogitsLossAndGradients) {
  for (const int t : tp_sizes()) {
    LlamaConfig config = fixture(GetParam());
    if (!splits(config, t)) {
      EXPECT_THROW(mdist::hf::check_tensor_parallel_split(config, t), mdist::Error);
      continue;
    }
    expect_split_matches(config, t, GetParam() + " tp=" + std::to_string(t));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TpArchitectures,
                         ::testing::Values("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2",
                                           "gemma2", "gemma3"));

TEST(TpLlama, BiasesTiedHeadAndReplicatedKvHeadsMatchTheUnsplitModel) {
  for (const int t : tp_sizes()) {
    // 6 query heads over 2 or 3 ranks with one KV head (replicated on every rank); 4 heads
    // with one or two KV heads over 4 ranks.
    std::vector<LlamaConfig> configs;
    if (t <= 3) configs = {small(6, 1), small(6, 6 / t * t == 6 ? 3 : 1)};
    if (t == 4) configs = {small(4, 1), small(4, 2), small(8, 4)};
    for (auto& config : configs) {
      if (config.num_key_value_heads % t != 0 && t % config.num_key_value_heads != 0) continue;
      config.vocab_size = 12 * t;
      config.qkv_bias = true;
      config.o_bias = true;
      config.mlp_bias = true;
      const std::string label = "heads " + std::to_string(config.num_attention_heads) + " kv " +
                                std::to_string(config.num_key_value_heads) +
                                " tp=" + std::to_string(t);
      expect_split_matches(config, t, label);
      config.tie_word_embeddings = true;
      config.qkv_bias = config.o_bias = config.mlp_bias = false;
      config.qk_norm = true;
      expect_split_matches(config, t, label + " tied qk_norm");
    }
  }
}

TEST(TpLlama, SplitsThatCannotWorkAreOneErrorNamingTheSizes) {
  const auto message = [](const LlamaConfig& c, int t) {
    try {
      mdist::hf::check_tensor_parallel_split(c, t);
    } catch (const mdist::Error& error) {
      return std::string(error.what());
    }
    return std::string();
  };
  EXPECT_NE(message(small(4, 2), 3).find("num_attention_heads 4 does not divide by 3"),
            std::string::npos);
  EXPECT_NE(message(small(6, 2), 3).find("num_key_value_heads 2"), std::string::npos);
  EXPECT_NE(message(small(4, 4, 30), 4).find("vocab_size 30 does not divide by 4"),
            std::string::npos);
  LlamaConfig odd = small(4, 4);
  odd.intermediate_size = 50;
  EXPECT_NE(message(odd, 4).find("intermediate_size 50"), std::string::npos);
  EXPECT_EQ(message(small(4, 1), 4), "");
  // A fused qkv_proj (Phi-3) or a k norm over every KV head (OLMo 2) splits by whole KV heads.
  LlamaConfig fused = small(4, 1);
  fused.architecture = "Phi3ForCausalLM";
  fused.fused_projections = true;
  EXPECT_NE(message(fused, 2).find("num_key_value_heads 1 does not divide by 2 (Phi3ForCausalLM's "
                                   "fused self_attn.qkv_proj splits by whole KV heads per rank)"),
            std::string::npos);
  EXPECT_EQ(message(small(4, 2), 2), "");
  LlamaConfig full_width = small(4, 1);
  full_width.architecture = "Olmo2ForCausalLM";
  full_width.qk_norm = full_width.qk_norm_full_width = true;
  EXPECT_NE(message(full_width, 4).find("(Olmo2ForCausalLM's self_attn.k_norm over all KV heads"),
            std::string::npos);
  // parallelize after fsdp2_wrap: the plan must come first.
  CausalLM wrapped = seeded(small(4, 4));
  mdist::fsdp2_wrap(*wrapped);
  const auto state = mdist::make_parallel_state({});
  EXPECT_THROW(mdist::hf::parallelize(wrapped, state), mdist::Error);
}

// The largest single CPU allocation while it is installed (c10's memory-profiling hook, which
// the CPU allocator calls for every allocation; it follows the thread into autograd).
struct LargestAllocation : c10::MemoryReportingInfoBase {
  int64_t largest = 0;
  void reportMemoryUsage(void*, int64_t bytes, size_t, size_t, c10::Device) override {
    largest = std::max(largest, bytes);
  }
  bool memoryProfilingEnabled() const override { return true; }
};

// A split model never holds the full logits, the full embedding or the full head: with a large
// vocabulary those are the biggest tensors of the unsplit step, and no allocation of the split
// forward, loss and backward comes near them.
// The collectives' bytes belong to the model's plan, not to the process: two models split
// alike count their own traffic each (the same for the same forward), and a reset clears one
// plan's only.
TEST(TpLlama, CountsCommunicationPerPlan) {
  const int t = mdist::size();
  LlamaConfig config = small(4, 4, 16 * t);
  if (t == 1 || config.num_attention_heads % t != 0) GTEST_SKIP() << "needs 2 or 4 ranks";
  const auto state = mdist::make_parallel_state({.tensor_parallel = t});
  CausalLM first = seeded(config), second = seeded(config);
  const auto a = mdist::hf::parallelize(first, state), b = mdist::hf::parallelize(second, state);
  torch::manual_seed(5);
  const at::Tensor ids = torch::randint(0, config.vocab_size, {2, 5});
  const at::NoGradGuard no_grad;
  (void)a->loss(first->forward(ids), ids);
  const mdist::tp::CommunicationBytes counted = a->communication();
  EXPECT_GT(counted.all_reduce, 0);
  EXPECT_EQ(b->communication().all_reduce, 0);
  (void)b->loss(second->forward(ids), ids);
  EXPECT_EQ(b->communication().all_reduce, counted.all_reduce);
  a->reset_communication();
  EXPECT_EQ(a->communication().all_reduce, 0);
  EXPECT_EQ(b->communication().all_reduce, counted.all_reduce);
}

TEST(TpLlama, NoRankAllocatesTheFullLogitsOrAFullVocabularyLayer) {
  for (const int t : tp_sizes()) {
    if (t != mdist::size()) continue;  // pure tensor parallelism over the world
    LlamaConfig config = small(4, 4, 1024 * t);
    if (config.num_attention_heads % t != 0) continue;
    const int64_t batch = 2, time = 16;
    const int64_t full_logits = batch * time * config.vocab_size * 4;
    const int64_t full_table = config.vocab_size * config.hidden_size * 4;
    torch::manual_seed(8);
    const at::Tensor ids = torch::randint(0, config.vocab_size, {batch, time});
    const auto state = mdist::make_parallel_state({.tensor_parallel = t});
    CausalLM model = seeded(config);
    const mdist::hf::Parallelism parallelism{.tensor_parallel =
                                                 mdist::hf::parallelize(model, state)};
    const auto probe = std::make_shared<LargestAllocation>();
    {
      const c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, probe);
      mdist::hf::causal_lm_loss(parallelism, model->forward(ids), ids).backward();
    }
    // Each rank's parts are 1 / t of them; allow for the other small tensors of the step.
    EXPECT_LE(probe->largest, std::max(full_logits, full_table) / t + (64 << 10))
        << "tp=" << t << ": an allocation of " << probe->largest << " bytes (full logits "
        << full_logits << ", full embedding " << full_table << ")";
    EXPECT_GT(probe->largest, 0) << "the allocation probe saw nothing";
    // The unsplit step does allocate them (the probe works).
    CausalLM whole = seeded(config);
    const auto whole_probe = std::make_shared<LargestAllocation>();
    {
      const c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, whole_probe);
      mdist::hf::causal_lm_loss(whole->forward(ids), ids).backward();
    }
    EXPECT_GE(whole_probe->largest, std::min(full_logits, full_table));
  }
}

// ---- TP x FSDP2 ----

std::vector<std::pair<int, int>> layouts() {  // (dp, tp)
  std::vector<std::pair<int, int>> out{{mdist::size(), 1}};
  for (const int t : tp_sizes()) out.emplace_back(mdist::size() / t, t);
  return out;
}

// Ten AdamW steps with clipping on a global batch split over dp, the model split over tp: the
// losses and the saved checkpoint equal a single-process run on the whole batch.
TEST(TpFsdp, TrainingOnEveryLayoutMatchesOneProcessAndSavesTheHfLayout) {
  for (const std::string arch : {"llama", "qwen2", "qwen3", "phi3", "olmo2"}) {
    const LlamaConfig config = fixture(arch);
    torch::manual_seed(6);
    const int64_t global_batch = 12;
    const at::Tensor data = torch::randint(0, config.vocab_size, {10, global_batch, 8});
    std::vector<double> expected;
    CausalLM reference = seeded(config);
    {
      torch::optim::AdamW opt(reference->parameters(),
                              torch::optim::AdamWOptions(3e-3).weight_decay(0.1));
      for (int step = 0; step < 10; ++step) {
        opt.zero_grad();
        const at::Tensor loss =
            mdist::hf::causal_lm_loss(reference->forward(data[step]), data[step]);
        loss.backward();
        torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.5);
        opt.step();
        expected.push_back(loss.item<double>());
      }
    }
    for (const auto& [dp, t] : layouts()) {
      if (!splits(config, t)) continue;
      const std::string label =
          arch + " (dp, tp) = (" + std::to_string(dp) + ", " + std::to_string(t) + ")";
      const auto state = mdist::make_parallel_state({.tensor_parallel = t});
      CausalLM model = seeded(config);
      const auto plan = mdist::hf::parallelize(model, state);
      mdist::fsdp2_wrap(*model, true, std::nullopt, false, state.data_parallel_group.group());
      torch::optim::AdamW opt(model->parameters(),
                              torch::optim::AdamWOptions(3e-3).weight_decay(0.1));
      const int dp_rank = state.data_parallel_group.rank();
      const int64_t local = global_batch / dp;
      for (int step = 0; step < 10; ++step) {
        opt.zero_grad();
        const at::Tensor batch = data[step].narrow(0, dp_rank * local, local);
        const at::Tensor loss = plan->loss(model->forward(batch), batch);
        loss.backward();
        mdist::hf::clip_grad_norm_(model, {.tensor_parallel = plan}, 0.5);
        opt.step();
        // The mean over the data-parallel ranks' (equal-sized) batches is the global loss.
        const double global =
            mdist::allreduce(loss.item<double>(), "sum", state.data_parallel_group.group()) / dp;
        EXPECT_NEAR(global, expected[static_cast<std::size_t>(step)],
                    1e-5 * expected[static_cast<std::size_t>(step)])
            << label << " step " << step;
      }
      const std::string dir = mdist::broadcast(
          (std::filesystem::temp_directory_path() /
           ("mdist-tp-save-" + std::to_string(::getpid()) + "-" + arch + "-" + std::to_string(t)))
              .string());
      mdist::hf::save_pretrained(model, {.tensor_parallel = plan}, dir);
      mdist::barrier();
      const mdist::hf::SafetensorsCheckpoint saved(dir);
      for (const auto& item : reference->named_parameters()) {
        ASSERT_TRUE(saved.contains(item.key())) << label << " " << item.key();
        const at::Tensor tensor = saved.tensor(item.key());
        ASSERT_EQ(tensor.sizes(), item.value().sizes()) << label << " " << item.key();
        // k_proj's bias gets a gradient of exactly zero in exact arithmetic (it shifts every
        // score of a query by the same amount), so its float gradient is rounding noise
        // that AdamW turns into steps of about the learning rate, on one process as on many.
        if (item.key().ends_with("k_proj.bias")) continue;
        EXPECT_LT(max_diff(tensor, item.value().detach()), 2e-5) << label << " " << item.key();
      }
      EXPECT_EQ(saved.names().size(), reference->named_parameters().size()) << label;
      // Loaded back split over every layout: each rank reads only its slice's rows.
      for (const auto& [dp2, t2] : layouts()) {
        if (!splits(config, t2)) continue;
        const auto state2 = mdist::make_parallel_state({.tensor_parallel = t2});
        auto [loaded, parallelism] = mdist::hf::load_pretrained_fsdp2(dir, {.parallel = state2});
        const at::NoGradGuard no_grad;
        const at::Tensor ids = data[0].narrow(0, 0, 2);
        EXPECT_LT(max_diff(mdist::hf::full_logits(parallelism, loaded->forward(ids)),
                           reference->forward(ids)),
                  1e-4)
            << label << " loaded on tp=" << t2;
        (void)dp2;
      }
      mdist::barrier();
      if (mdist::is_master()) std::filesystem::remove_all(dir);
    }
  }
}

// Each rank's persistent parameter bytes are the total over dp x tp, plus what is replicated
// (the norms), within 5 %; no parameter is whole except those.
TEST(TpFsdp, EachRankHoldsItsShareOfTheParameters) {
  LlamaConfig config = small(8, 4, 64);
  config.num_hidden_layers = 2;
  for (const auto& [dp, t] : layouts()) {
    if (config.num_attention_heads % t != 0 || config.vocab_size % t != 0) continue;
    const auto state = mdist::make_parallel_state({.tensor_parallel = t});
    CausalLM model(config, c10::kMeta);
    const auto plan = mdist::hf::parallelize(model, state);
    mdist::fsdp2_wrap(*model, true, std::nullopt, false, state.data_parallel_group.group());
    int64_t total = 0, replicated = 0;
    {
      CausalLM whole(config, c10::kMeta);
      for (const auto& item : whole->named_parameters()) {
        total += item.value().numel();
        if (plan->placement(item.key()).split == Split::kReplicated) {
          replicated += item.value().numel();
        }
      }
    }
    int64_t held = 0;
    for (const auto& item : model->named_parameters()) {
      EXPECT_FALSE(item.value().is_meta()) << item.key();
      held += item.value().numel();
    }
    const double share =
        static_cast<double>(total - replicated) / (dp * t) + static_cast<double>(replicated) / dp;
    EXPECT_LT(std::abs(static_cast<double>(held) - share) / share, 0.05)
        << "(dp, tp) = (" << dp << ", " << t << "): " << held << " elements, expected " << share;
  }
}

}  // namespace
