// Gradient accumulation in the trainer (TrainerOptions::micro_batch), run by mdistrun with 1-4
// ranks: K micro-batches of B sequences per rank give the losses and weights of one forward of
// K x B in every layout the world allows (data parallel, tp 2 on a dense model, ep 2: tensor
// parallelism of MoE layers is not implemented); FSDP reduce-scatters as
// often as without accumulation and never before the last micro-batch's backward; a mixture of
// experts trains on the mean of its micro-batches' load-balancing losses; a checkpoint written
// with micro-batches resumes exactly, also into another micro-batch size.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mdist/fsdp/state_dict.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/hf/parallelize.h"
#include "mdist/hf/pretrained.h"
#include "mdist/hf/safetensors.h"
#include "mdist/mdist.h"
#include "mdist/runtime/device.h"
#include "mdist/train/checkpoint.h"
#include "mdist/train/loss.h"
#include "mdist/train/trainer.h"

namespace {

namespace fs = std::filesystem;
using mdist::hf::CausalLM;
using mdist::hf::LlamaConfig;
using mdist::train::StepStats;
using mdist::train::Trainer;

constexpr int kSteps = 3, kSeqLen = 8;
constexpr std::int64_t kPerRank = 4;  // sequences per data-parallel rank per step
// K micro-batches against one forward of their union: they differ only in the order of fp32
// sums (per micro-batch, then accumulated), so the losses agree to 1e-6 and the gradients to
// 3e-6 relative to each tensor's largest (dense: at most 6.1e-7; the MoE's, whose expert
// gradients are sums over fewer routed tokens times router weights: 1.4e-6 on an AVX-512 AMD
// EPYC, below 1e-6 on the machine the test was written on). The weights after AdamW steps agree to
// 1e-6 except where AdamW's first step, lr x g / (|g| + eps) with eps 1e-8, meets a gradient
// element of the size of eps: there the fp32 rounding of g (measured: -8.38e-9 against -8.16e-9 in
// a down_proj on 2 ranks, where the tensor's gradients reach 2.6e-3) moves the weight by 6.6e-6 at
// lr 1e-3. Any change of summation order (another rank count) does the same.
constexpr double kLossTolerance = 1e-6, kGradientTolerance = 3e-6, kWeightTolerance = 2e-5;

LlamaConfig fixture(const std::string& arch) {
  return LlamaConfig::from_file(std::string(MDIST_HF_MODEL_FIXTURES) + "/" + arch + "/config.json");
}

struct Layout {
  int tp = 1;
  int ep = 1;
  bool fits() const { return mdist::size() % (tp * ep) == 0; }
  int dp() const { return mdist::size() / tp; }
};

struct Job {
  mdist::hf::ParallelModel model;
  mdist::ParallelState state;
};

mdist::hf::ParallelLayout parallel_layout(const Layout& layout) {
  const mdist::ParallelSizes sizes{.tensor_parallel = layout.tp,
                                   .expert_model_parallel = layout.ep};
  mdist::hf::ParallelLayout parallel{.parallel = mdist::make_parallel_state(sizes)};
  if (layout.ep > 1) parallel.expert_data_parallel = mdist::make_expert_data_parallel_group(sizes);
  return parallel;
}

// The same seeded model in every call, split and sharded for `layout`.
Job seeded_job(const LlamaConfig& config, const Layout& layout) {
  const mdist::hf::ParallelLayout parallel = parallel_layout(layout);
  torch::manual_seed(17);
  CausalLM model(config);
  mdist::hf::Parallelism parallelism = mdist::hf::apply_parallelism(model, parallel);
  return {{model, std::move(parallelism)}, parallel.parallel};
}

// The model of a checkpoint, split and sharded for `layout`.
Job loaded_job(const fs::path& checkpoint, const Layout& layout) {
  const mdist::hf::ParallelLayout parallel = parallel_layout(layout);
  return {mdist::hf::load_pretrained_fsdp2(checkpoint,
                                           {.parallel = parallel.parallel,
                                            .expert_data_parallel = parallel.expert_data_parallel}),
          parallel.parallel};
}

// 64 seeded sequences, read round and round; `repeat` > 1 makes each block of repeat x B
// sequences B distinct ones repeated (position p reads (p / (repeat x B)) x B + p % B).
mdist::train::SequenceSource data(const LlamaConfig& config, std::int64_t repeat = 1,
                                  std::int64_t block = 1) {
  torch::manual_seed(5);
  const at::Tensor sequences = torch::randint(0, config.vocab_size, {64, kSeqLen});
  mdist::train::SequenceSource source;
  source.count = sequences.size(0);
  source.length = kSeqLen;
  source.rows = [sequences, repeat, block](const std::vector<std::int64_t>& which) {
    std::vector<std::int64_t> rows;
    for (const std::int64_t p : which) {
      const std::int64_t distinct = (p / (repeat * block)) * block + p % block;
      rows.push_back(distinct % sequences.size(0));
    }
    return mdist::train::Batch{.ids = sequences.index_select(0, torch::tensor(rows, torch::kLong))};
  };
  source.description = "seeded";
  return source;
}

// data() with supervised-style labels, ragged by position p in the stream: the first p % 5
// labels ignored (a prompt), right padding after T - p % 3 real tokens (id 0, attention mask
// 0, labels ignored), and every sequence at p % 8 == 2 ignored whole, so that some
// micro-batches of one sequence predict nothing.
mdist::train::SequenceSource masked_data(const LlamaConfig& config) {
  mdist::train::SequenceSource source = data(config);
  source.rows = [rows = source.rows](const std::vector<std::int64_t>& which) {
    mdist::train::Batch batch = rows(which);
    batch.labels = batch.ids.clone();
    batch.attention_mask = torch::ones_like(batch.ids);
    for (std::size_t b = 0; b < which.size(); ++b) {
      const std::int64_t p = which[b], i = static_cast<std::int64_t>(b);
      const std::int64_t length = kSeqLen - p % 3;
      batch.labels[i].narrow(0, 0, p % 5).fill_(-100);
      batch.ids[i].narrow(0, length, kSeqLen - length).fill_(0);
      batch.labels[i].narrow(0, length, kSeqLen - length).fill_(-100);
      batch.attention_mask[i].narrow(0, length, kSeqLen - length).fill_(0);
      if (p % 8 == 2) batch.labels[i].fill_(-100);
    }
    return batch;
  };
  source.description = "seeded, masked";
  return source;
}

mdist::train::TrainerOptions options(const Layout& layout, std::optional<std::int64_t> micro,
                                     std::int64_t per_rank = kPerRank) {
  mdist::train::TrainerOptions o;
  o.steps = kSteps + 1;  // room for the resumed run's last step
  o.global_batch = layout.dp() * per_rank;
  o.micro_batch = micro;
  o.schedule = {.peak = 1e-3, .warmup_steps = 1, .total_steps = o.steps, .min_ratio = 0.1};
  return o;
}

std::unique_ptr<Trainer> trainer(Job job, mdist::train::SequenceSource source,
                                 mdist::train::TrainerOptions o,
                                 std::unique_ptr<mdist::train::LossFunction> loss) {
  return std::make_unique<Trainer>(std::move(job.model), std::move(job.state), std::move(source),
                                   std::move(o), std::move(loss), nlohmann::json::object());
}

std::unique_ptr<mdist::train::LossFunction> causal_lm_loss(const LlamaConfig& config,
                                                           double aux_weight = 0) {
  return std::make_unique<mdist::train::CausalLmLoss>(config, aux_weight);
}

std::vector<StepStats> run(Trainer& t, int steps) {
  std::vector<StepStats> stats;
  for (int i = 0; i < steps; ++i) stats.push_back(t.step());
  return stats;
}

// The largest difference between the two trainers' parameters (or, `gradients`, between their
// gradients relative to the tensor's largest), over this rank's shards and then over the world
// (both in the same layout: the same shards on each rank).
double difference(Trainer& a, Trainer& b, bool gradients = false) {
  const auto pa = a.model()->named_parameters(), pb = b.model()->named_parameters();
  double worst = 0;
  for (const auto& item : pa) {
    const at::Tensor mine = gradients ? item.value().grad() : item.value();
    const at::Tensor other = gradients ? pb[item.key()].grad() : pb[item.key()];
    EXPECT_EQ(mine.defined(), other.defined()) << item.key();
    if (!mine.defined() || !other.defined() || mine.numel() == 0) continue;
    EXPECT_EQ(mine.sizes(), other.sizes()) << item.key();
    const double scale = gradients ? other.abs().max().item<double>() : 1.0;
    if (scale == 0) continue;
    worst = std::max(worst, (mine - other).abs().max().item<double>() / scale);
  }
  return mdist::allreduce(worst, "max");
}
double weight_difference(Trainer& a, Trainer& b) { return difference(a, b); }
double gradient_difference(Trainer& a, Trainer& b) { return difference(a, b, true); }

void expect_same_losses(const std::vector<StepStats>& got, const std::vector<StepStats>& want,
                        double tolerance, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i].loss, want[i].loss, tolerance * want[i].loss) << what << ", step " << i + 1;
    EXPECT_NEAR(got[i].grad_norm, want[i].grad_norm, 1e-5 * want[i].grad_norm)
        << what << ", step " << i + 1;
  }
}

// ---------------------------------------------------------------------------------------------
// K micro-batches equal one forward of K x B, in every layout.

struct Case {
  std::string name;
  std::string arch;
  Layout layout;
  bool masked = false;  // masked_data: ignored labels, padding, micro-batches with no token
};

// Test names show the case's name, not the struct's bytes.
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class MicroBatches : public ::testing::TestWithParam<Case> {};

TEST_P(MicroBatches, EqualOneBatchOfTheirUnion) {
  const Case& c = GetParam();
  if (!c.layout.fits()) GTEST_SKIP() << "needs a multiple of " << c.layout.tp * c.layout.ep;
  const LlamaConfig config = fixture(c.arch);
  // The load-balancing loss is measured but not trained on: it is a per-forward statistic,
  // not additive over micro-batches (LoadBalancingLossIsTheMeanOverMicroBatches).
  const auto make = [&](std::optional<std::int64_t> micro) {
    return trainer(seeded_job(config, c.layout), c.masked ? masked_data(config) : data(config),
                   options(c.layout, micro), causal_lm_loss(config));
  };
  auto whole = make({});
  EXPECT_EQ(whole->micro_batches(), 1);
  const auto want = run(*whole, 1);
  for (std::int64_t micro = 1; micro < kPerRank; micro *= 2) {
    const std::string what = c.name + ", micro-batch " + std::to_string(micro);
    auto split = make(micro);
    EXPECT_EQ(split->micro_batches(), kPerRank / micro);
    auto got = run(*split, 1);
    // The first step's gradients, from the same weights (clipped alike): the claim itself.
    const double gradients = gradient_difference(*split, *whole);
    EXPECT_LE(gradients, kGradientTolerance) << what;
    auto later = run(*split, kSteps - 1);
    got.insert(got.end(), later.begin(), later.end());
    // A K = 1 run to the same step (a fresh one: `whole` stays at step 1 for the next
    // micro-batch size's gradients).
    auto reference = make({});
    const auto want_all = run(*reference, kSteps);
    EXPECT_EQ(want_all.front().loss, want.front().loss);
    expect_same_losses(got, want_all, kLossTolerance, what);
    const double weights = weight_difference(*split, *reference);
    EXPECT_LE(weights, kWeightTolerance) << what;
    if (mdist::rank() == 0) {
      std::cout << what << ": first-step gradients differ by " << gradients
                << " (relative to each tensor's largest), weights after " << kSteps << " steps by "
                << weights << std::endl;
    }
    if (config.moe) {
      for (std::size_t i = 0; i < got.size(); ++i) EXPECT_GT(got[i].aux_loss, 0) << what;
    }
    if (c.layout.ep > 1) {
      EXPECT_GT(got.back().all_to_all_bytes.at(0), 0) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, MicroBatches,
                         ::testing::Values(Case{"Dense", "llama", {}},
                                           Case{"DenseTp2", "llama", {.tp = 2}},
                                           Case{"Moe", "qwen3_moe", {}},
                                           Case{"MoeEp2", "qwen3_moe", {.ep = 2}},
                                           Case{"DenseMasked", "llama", {}, true},
                                           Case{"DenseTp2Masked", "llama", {.tp = 2}, true},
                                           Case{"MoeEp2Masked", "qwen3_moe", {.ep = 2}, true}),
                         [](const auto& param_info) { return param_info.param.name; });

// With ignored labels and padding, a step's loss is the mean over the step's predicted tokens
// (transformers' loss of the whole global batch at once), however the tokens fall into ranks
// and micro-batches, micro-batches with none among them: against one forward of the global
// batch on an unsplit copy of the same model.
TEST(Accumulation, MaskedLossIsTheMeanOverTheStepsPredictedTokens) {
  const LlamaConfig config = fixture("qwen3_moe");
  const Layout layout;
  const auto source = masked_data(config);
  auto t = trainer(seeded_job(config, layout), source, options(layout, 1), causal_lm_loss(config));
  const StepStats got = t->step();
  torch::manual_seed(17);  // seeded_job's model, unsplit, before any update
  CausalLM plain(config);
  const at::NoGradGuard no_grad;
  const std::int64_t global = layout.dp() * kPerRank;
  std::vector<std::int64_t> which;
  for (std::int64_t p = 0; p < global; ++p) which.push_back(p);
  const mdist::train::Batch batch = source.rows(which);
  ASSERT_EQ(batch.labels[2].ne(-100).sum().item<std::int64_t>(), 0)
      << "the test's data has no micro-batch without a predicted token";
  const at::Tensor logits = plain->forward(batch.ids, batch.attention_mask);
  const double want = mdist::hf::causal_lm_loss(logits, batch.labels).item<double>();
  EXPECT_NEAR(got.loss, want, kLossTolerance * want);
  // The load-balancing loss of each forward (one sequence here) leaves its padding out, as
  // transformers' does with the mask; the step reports the mean over the forwards.
  double aux = 0;
  for (const std::int64_t p : which) {
    const mdist::train::Batch one = source.rows({p});
    static_cast<void>(plain->forward(one.ids, one.attention_mask));
    aux += plain->aux_loss(one.attention_mask).item<double>() / static_cast<double>(global);
  }
  EXPECT_NEAR(got.aux_loss, aux, 1e-6 * aux);
  if (mdist::rank() == 0) {
    std::cout << "masked first step: loss " << got.loss << " against " << want
              << " of one forward of the global batch" << std::endl;
  }
}

// ---------------------------------------------------------------------------------------------
// FSDP's reduce-scatters: as many per step as without accumulation, none before the last
// micro-batch's backward.

std::int64_t reduce_scatters(CausalLM& model) {
  std::int64_t count = 0;
  for (const auto& module : model->modules()) {
    if (const auto unit = mdist::fsdp_handle(*module))
      count += unit->communication().reduce_scatters;
  }
  return count;
}

// The causal-LM loss that also records the model's reduce-scatters so far at each call (after
// a micro-batch's forward, before its backward).
class CountingLoss final : public mdist::train::LossFunction {
 public:
  explicit CountingLoss(const LlamaConfig& config) : loss_(config, 0) {}
  std::int64_t predicted_tokens(const mdist::train::Batch& batch) const override {
    return loss_.predicted_tokens(batch);
  }
  mdist::train::LossParts operator()(CausalLM& model, const mdist::hf::Parallelism& parallelism,
                                     const at::Tensor& logits, const mdist::train::Batch& batch,
                                     const mdist::train::LossNormalisation& n) override {
    seen.push_back(reduce_scatters(model));
    return loss_(model, parallelism, logits, batch, n);
  }
  bool reports_aux_loss() const override { return loss_.reports_aux_loss(); }
  double aux_loss_weight() const override { return 0; }

  std::vector<std::int64_t> seen;

 private:
  mdist::train::CausalLmLoss loss_;
};

TEST(Accumulation, ReduceScattersOnlyOnTheLastMicroBatchAndAsOftenAsWithout) {
  for (const Layout layout : {Layout{}, Layout{.ep = 2}}) {
    if (!layout.fits()) continue;
    const LlamaConfig config = fixture(layout.ep > 1 ? "qwen3_moe" : "llama");
    const std::string what = layout.ep > 1 ? "ep 2" : "data parallel";
    std::vector<std::int64_t> per_step;
    for (const std::optional<std::int64_t> micro :
         {std::optional<std::int64_t>(), std::optional<std::int64_t>(1)}) {
      auto counting = std::make_unique<CountingLoss>(config);
      CountingLoss& probe = *counting;
      auto t = trainer(seeded_job(config, layout), data(config), options(layout, micro),
                       std::move(counting));
      const std::int64_t before = reduce_scatters(t->model());
      t->step();
      const std::int64_t forwards = t->micro_batches();
      ASSERT_EQ(static_cast<std::int64_t>(probe.seen.size()), forwards) << what;
      // No backward before the last micro-batch's reduced anything.
      for (const std::int64_t seen : probe.seen) EXPECT_EQ(seen, before) << what;
      per_step.push_back(reduce_scatters(t->model()) - before);
      // A second step: the sync is on again for the last micro-batch, off for the others.
      probe.seen.clear();
      const std::int64_t second = reduce_scatters(t->model());
      t->step();
      for (const std::int64_t seen : probe.seen) EXPECT_EQ(seen, second) << what;
      EXPECT_EQ(reduce_scatters(t->model()) - second, per_step.back()) << what;
    }
    EXPECT_EQ(per_step[1], per_step[0]) << what << ": with 4 micro-batches and without";
    // One rank reduces locally, without a reduce-scatter; more ranks do one per unit.
    if (mdist::size() > 1) {
      EXPECT_GT(per_step[0], 0) << what;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// A mixture of experts' load-balancing loss with accumulation: the mean over micro-batches.

TEST(Accumulation, LoadBalancingLossIsTheMeanOverMicroBatches) {
  const Layout layout;
  const LlamaConfig config = fixture("qwen3_moe");
  const double weight = 0.1;
  const std::int64_t micro = 2;
  // Reported: the step's aux_loss is the mean over ranks of each rank's micro-batches' losses,
  // measured here by forwards of the same micro-batches on the same (untrained) model.
  double expected = 0;
  {
    auto probe = seeded_job(config, layout);
    const auto source = data(config);
    const at::NoGradGuard no_grad;
    for (std::int64_t k = 0; k < kPerRank / micro; ++k) {
      std::vector<std::int64_t> which;
      for (std::int64_t b = 0; b < micro; ++b)
        which.push_back(mdist::rank() * kPerRank + k * micro + b);
      static_cast<void>(
          probe.model.model->forward(source.rows(which).ids.to(mdist::compute_device())));
      expected += probe.model.model->aux_loss().item<double>() / (kPerRank / micro);
    }
    expected = mdist::allreduce(expected) / mdist::size();
  }
  auto t = trainer(seeded_job(config, layout), data(config), options(layout, micro),
                   causal_lm_loss(config, weight));
  const StepStats first = t->step();
  EXPECT_NEAR(first.aux_loss, expected, 1e-6 * expected);

  // Trained: each micro-batch's load-balancing loss with weight / K. Micro-batches that repeat
  // the same B sequences then train exactly as one forward of those B (a sum over the
  // micro-batches would double the load-balancing loss's gradient and part the weights).
  auto once = trainer(seeded_job(config, layout), data(config), options(layout, {}, micro),
                      causal_lm_loss(config, weight));
  auto repeated = trainer(seeded_job(config, layout), data(config, kPerRank / micro, micro),
                          options(layout, micro), causal_lm_loss(config, weight));
  const auto want = run(*once, kSteps), got = run(*repeated, kSteps);
  expect_same_losses(got, want, kLossTolerance, "repeated micro-batches");
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i].aux_loss, want[i].aux_loss, 1e-6 * want[i].aux_loss) << "step " << i + 1;
  }
  EXPECT_LE(weight_difference(*repeated, *once), kWeightTolerance);
}

// ---------------------------------------------------------------------------------------------
// Resume: a checkpoint written with micro-batches continues exactly, in the same or another
// micro-batch size.

TEST(Accumulation, ResumesExactlyIntoAnyMicroBatchSize) {
  const Layout layout;
  const LlamaConfig config = fixture("llama");
  const fs::path run_dir = mdist::broadcast(
      (fs::temp_directory_path() / ("mdist-accumulation-" + std::to_string(::getpid()))).string());
  auto whole =
      trainer(seeded_job(config, layout), data(config), options(layout, 2), causal_lm_loss(config));
  run(*whole, 2);
  whole->save(run_dir, 1, {});
  const auto want_rest = run(*whole, 2);
  const auto checkpoint = mdist::train::latest_checkpoint(run_dir);
  ASSERT_TRUE(checkpoint.has_value());
  const mdist::train::TrainerState state = mdist::train::read_trainer_state(*checkpoint);
  EXPECT_EQ(state.step, 2);
  for (const std::optional<std::int64_t> micro :
       {std::optional<std::int64_t>(2), std::optional<std::int64_t>(1),
        std::optional<std::int64_t>()}) {
    const std::string what = "resumed with micro-batch " + (micro ? std::to_string(*micro) : "all");
    auto resumed = trainer(loaded_job(*checkpoint, layout), data(config), options(layout, micro),
                           causal_lm_loss(config));
    resumed->resume(*checkpoint, state);
    const auto got = run(*resumed, 2);
    if (micro == 2) {
      // The same arithmetic as the uninterrupted run: bit for bit.
      for (std::size_t i = 0; i < got.size(); ++i)
        EXPECT_EQ(got[i].loss, want_rest[i].loss) << what;
      EXPECT_EQ(weight_difference(*resumed, *whole), 0.0) << what;
    } else {
      expect_same_losses(got, want_rest, kLossTolerance, what);
      EXPECT_LE(weight_difference(*resumed, *whole), kWeightTolerance) << what;
    }
  }
  mdist::barrier();
  if (mdist::rank() == 0) fs::remove_all(run_dir);
}

// ---------------------------------------------------------------------------------------------
// Against PyTorch's own FSDP2 (make_accumulation_reference.py, run with torchrun on 2 ranks):
// the same initial weights and data (ragged labels, padding, a micro-batch with no predicted
// token), micro-batches with the gradient sync only on the last and the loss normalised by
// the step's global count of predicted tokens. The reference's micro-batch and the others
// (one sequence per forward, the rank's whole batch) give its losses and weights.

TEST(Accumulation, EqualsPyTorchFsdp2OnTwoRanks) {
  if (mdist::size() != 2) GTEST_SKIP() << "the reference ran on 2 ranks";
  const fs::path dir = MDIST_ACCUMULATION_REFERENCE;
  std::ifstream expected_file(dir / "expected.json");
  ASSERT_TRUE(expected_file) << dir;
  const auto expected = nlohmann::json::parse(expected_file);
  const auto& settings = expected.at("settings");
  ASSERT_EQ(settings.at("ranks").get<int>(), 2);
  const mdist::hf::SafetensorsFile data_file(dir / "data.safetensors");
  const at::Tensor ids = data_file.tensor("ids").clone();
  const at::Tensor labels = data_file.tensor("labels").clone();
  const at::Tensor mask = data_file.tensor("attention_mask").clone();
  mdist::train::SequenceSource source;
  source.count = ids.size(0);
  source.length = ids.size(1);
  source.rows = [=](const std::vector<std::int64_t>& which) {
    const at::Tensor rows = torch::tensor(which, torch::kLong).remainder(ids.size(0));
    return mdist::train::Batch{.ids = ids.index_select(0, rows),
                               .labels = labels.index_select(0, rows),
                               .attention_mask = mask.index_select(0, rows)};
  };
  source.description = "PyTorch FSDP2 reference";
  const mdist::hf::SafetensorsFile want_file(dir / "expected.safetensors");
  const LlamaConfig config = LlamaConfig::from_file(dir / "config.json");
  const auto per_rank = settings.at("per_rank").get<std::int64_t>();
  const auto steps = expected.at("steps");

  const auto reference_micro = settings.at("micro_batch").get<std::int64_t>();
  for (const std::optional<std::int64_t> micro :
       {std::optional<std::int64_t>(reference_micro), std::optional<std::int64_t>(1),
        std::optional<std::int64_t>()}) {
    const std::string what = "micro-batch " + (micro ? std::to_string(*micro) : "all");
    mdist::train::TrainerOptions o;
    o.steps = settings.at("steps").get<int>();
    o.global_batch = mdist::size() * per_rank;
    o.micro_batch = micro;
    o.schedule = {.peak = settings.at("peak_lr").get<double>(),
                  .warmup_steps = settings.at("warmup").get<int>(),
                  .total_steps = o.steps,
                  .min_ratio = settings.at("min_ratio").get<double>()};
    o.weight_decay = settings.at("weight_decay").get<double>();
    o.grad_clip = settings.at("grad_clip").get<double>();
    auto t = trainer(loaded_job(dir, Layout{}), source, o, causal_lm_loss(config));
    const auto got = run(*t, o.steps);
    ASSERT_EQ(got.size(), steps.size()) << what;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double loss = steps[i].at("loss").get<double>();
      const double norm = steps[i].at("grad_norm").get<double>();
      EXPECT_NEAR(got[i].loss, loss, kLossTolerance * loss) << what << ", step " << i + 1;
      EXPECT_NEAR(got[i].grad_norm, norm, 1e-5 * norm) << what << ", step " << i + 1;
      EXPECT_NEAR(got[i].lr, steps[i].at("lr").get<double>(), 1e-15) << what;
    }
    const auto weights = mdist::full_state_dict(*t->model());
    double worst = 0;
    if (mdist::rank() == 0) {
      // Every parameter of PyTorch's model (the dict may hold buffers besides).
      for (const std::string& name : want_file.names()) {
        ASSERT_TRUE(weights.contains(name)) << name;
        const at::Tensor& weight = weights.at(name);
        const at::Tensor want = want_file.tensor(name);
        ASSERT_EQ(weight.sizes(), want.sizes()) << name;
        worst = std::max(worst, (weight - want).abs().max().item<double>());
      }
      std::cout << what << ": losses " << got.front().loss << " .. " << got.back().loss
                << ", weights after " << o.steps << " steps differ from PyTorch's by " << worst
                << std::endl;
    }
    // Measured: 6e-8 with the reference's micro-batch, 3.3e-7 with the others (another
    // summation order, see kWeightTolerance): within the 1e-6.
    EXPECT_LE(worst, 1e-6) << what;
  }
}

// Phi-3 (fused qkv_proj / gate_up_proj, longrope past its pretraining length), OLMo 2 (post
// norms, full-width q/k norms), Gemma 2 (soft-capping, a sliding layer) and Gemma 3 train as
// transformers + PyTorch FSDP2 on 2 ranks (make_family_fsdp2_reference.py: 3 AdamW steps, one
// forward per rank, every token predicted): the same initial weights and data give the same
// losses and final weights (1e-5), with FSDP2 over the 2 ranks and with --tp 2 alike.
TEST(Accumulation, FamiliesEqualPyTorchFsdp2OnTwoRanks) {
  if (mdist::size() != 2) GTEST_SKIP() << "the references ran on 2 ranks";
  for (const std::string family : {"phi3", "olmo2", "gemma2", "gemma3"}) {
    const fs::path dir = fs::path(MDIST_FAMILY_FSDP2_REFERENCES) / family;
    std::ifstream expected_file(dir / "expected.json");
    ASSERT_TRUE(expected_file) << dir;
    const auto expected = nlohmann::json::parse(expected_file);
    const auto& settings = expected.at("settings");
    ASSERT_EQ(settings.at("ranks").get<int>(), 2);
    const mdist::hf::SafetensorsFile data_file(dir / "data.safetensors");
    const at::Tensor ids = data_file.tensor("ids").clone();
    const at::Tensor mask = data_file.tensor("attention_mask").clone();
    mdist::train::SequenceSource source;
    source.count = ids.size(0);
    source.length = ids.size(1);
    source.rows = [=](const std::vector<std::int64_t>& which) {
      const at::Tensor rows = torch::tensor(which, torch::kLong).remainder(ids.size(0));
      return mdist::train::Batch{.ids = ids.index_select(0, rows),
                                 .attention_mask = mask.index_select(0, rows)};
    };
    source.description = "PyTorch FSDP2 reference";
    const mdist::hf::SafetensorsFile want_file(dir / "expected.safetensors");
    const LlamaConfig config = LlamaConfig::from_file(dir / "config.json");
    const auto steps = expected.at("steps");
    for (const Layout layout : {Layout{}, Layout{.tp = 2}}) {
      const std::string what = family + " tp " + std::to_string(layout.tp);
      mdist::train::TrainerOptions o;
      o.steps = settings.at("steps").get<int>();
      o.global_batch = mdist::size() * settings.at("per_rank").get<std::int64_t>();
      o.schedule = {.peak = settings.at("peak_lr").get<double>(),
                    .warmup_steps = settings.at("warmup").get<int>(),
                    .total_steps = o.steps,
                    .min_ratio = settings.at("min_ratio").get<double>()};
      o.weight_decay = settings.at("weight_decay").get<double>();
      o.grad_clip = settings.at("grad_clip").get<double>();
      auto t = trainer(loaded_job(dir, layout), source, o, causal_lm_loss(config));
      const auto got = run(*t, o.steps);
      ASSERT_EQ(got.size(), steps.size()) << what;
      for (std::size_t i = 0; i < got.size(); ++i) {
        const double loss = steps[i].at("loss").get<double>();
        const double norm = steps[i].at("grad_norm").get<double>();
        EXPECT_NEAR(got[i].loss, loss, 1e-5 * loss) << what << ", step " << i + 1;
        EXPECT_NEAR(got[i].grad_norm, norm, 1e-5 * norm) << what << ", step " << i + 1;
      }
      // Every rank's tensors: the tensor-parallel ranks join theirs collectively.
      auto weights = mdist::full_state_dict(*t->model(), {.keep = true});
      if (t->parallelism().tensor_parallel_split()) {
        weights = t->parallelism().tensor_parallel->gather(weights);
      }
      if (mdist::rank() != 0) continue;
      double worst = 0;
      std::string worst_name;
      for (const std::string& name : want_file.names()) {
        ASSERT_TRUE(weights.contains(name)) << what << " " << name;
        const at::Tensor want = want_file.tensor(name);
        ASSERT_EQ(weights.at(name).sizes(), want.sizes()) << what << " " << name;
        const double diff = (weights.at(name) - want).abs().max().item<double>();
        if (diff > worst) {
          worst = diff;
          worst_name = name;
        }
      }
      EXPECT_LE(worst, 1e-5) << what;
      std::cout << what << ": losses " << got.front().loss << " .. " << got.back().loss
                << ", weights after " << o.steps << " steps within " << worst << " of PyTorch's ("
                << worst_name << ")" << std::endl;
    }
  }
}

// A micro-batch that does not divide the rank's batch is refused before anything runs.
TEST(Accumulation, AMicroBatchThatDoesNotDivideTheRanksBatchIsRefused) {
  const Layout layout;
  const LlamaConfig config = fixture("llama");
  for (const std::int64_t micro : {std::int64_t{0}, std::int64_t{3}, std::int64_t{8}}) {
    EXPECT_THROW(trainer(seeded_job(config, layout), data(config), options(layout, micro),
                         causal_lm_loss(config)),
                 mdist::InputError)
        << micro;
  }
}

}  // namespace
