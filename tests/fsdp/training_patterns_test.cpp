// fully_shard under training patterns beyond one forward, one backward and one step: a unit
// run several times per step, no-grad forwards in between, frozen and LoRA parameters,
// parameters unused in some steps or on some ranks, replicated (ignored) parameters, tied
// weights, in-place ops on unit outputs, failed steps, several models in one process, loading
// by rows, and gradient accumulation.
//
// Each training test compares a sharded run, each rank on its slice of a global batch of 12,
// with a single-process reference on the whole batch: 5 AdamW steps (lr 1e-2, weight decay
// 0.01), the global loss (mean of the ranks' means) within 1e-6 relative and the final full
// weights within 1e-5 relative. Run by mdistrun with 1, 2, 3 and 4 ranks; every rank runs the
// same tests in the same order, so whatever a test does collectively it does on every rank.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/fsdp/state_dict.h"
#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/mdist.h"
#include "tests/fsdp/hf_shaped_lm.h"
#include "tests/fsdp/mlp.h"
#include "tests/fsdp/tiny_transformer.h"
#include "tests/support/error_of.h"

namespace {

using mdist::testing::error_of;
using mdist::testing::Mlp;
using ::testing::HasSubstr;

constexpr int kGlobalBatch = 12;  // divisible by 1, 2, 3 and 4 ranks
constexpr int kSteps = 5;
constexpr int64_t kVocab = 16;  // token ids of the language-model tests are below this

// ---------------------------------------------------------------------------------------------
// Shared helpers: batches, training loops, comparisons.

struct Batch {
  at::Tensor x;    // [n, 8] features
  at::Tensor y;    // [n, 5] regression targets
  at::Tensor ids;  // [n, 6] token ids in [0, kVocab)
};

Batch global_batch(int step) {
  torch::manual_seed(4000 + step);
  Batch batch;
  batch.x = torch::randn({kGlobalBatch, 8});
  batch.y = torch::randn({kGlobalBatch, 5});
  batch.ids = torch::randint(0, kVocab, {kGlobalBatch, 6});
  return batch;
}

int64_t rows_per_rank() { return kGlobalBatch / mdist::size(); }
int64_t first_local_row() { return mdist::rank() * rows_per_rank(); }

// This rank's rows of a tensor over the global batch.
at::Tensor local_rows(const at::Tensor& global) {
  return global.narrow(0, first_local_row(), rows_per_rank());
}

Batch local_batch(const Batch& global) {
  return {local_rows(global.x), local_rows(global.y), local_rows(global.ids)};
}

// The global loss: the mean of the ranks' means over equal local batches.
double global_mean(const at::Tensor& local_loss) {
  return mdist::allreduce(local_loss.item<double>()) / mdist::size();
}

// How many real (non-padding) rows of a parameter with `rows` rows this rank's shard holds:
// rank r owns rows [r*c, (r+1)*c), c = ceil(rows / world).
int64_t owned_rows(int64_t rows) {
  const int64_t world = mdist::size();
  const int64_t chunk = (rows + world - 1) / world;
  return std::clamp<int64_t>(rows - mdist::rank() * chunk, 0, chunk);
}

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.detach().to(at::kDouble);
  const at::Tensor y = b.detach().to(at::kDouble);
  return ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item<double>();
}

using Params = std::map<std::string, at::Tensor>;

// An unwrapped model's parameters, by name.
Params own_params(const torch::nn::Module& model) {
  Params params;
  for (const auto& p : model.named_parameters()) params[p.key()] = p.value().detach().clone();
  return params;
}

// A wrapped model's full parameters (and buffers), gathered on every rank.
Params full_params(torch::nn::Module& model) {
  return mdist::full_state_dict(model, {.rank0_only = false, .cpu = true});
}

// parameters() without repeats: a tied weight is registered under two names, and an optimizer
// given it twice would step it twice.
std::vector<at::Tensor> unique_parameters(const torch::nn::Module& model) {
  std::vector<at::Tensor> params;
  std::set<const at::TensorImpl*> seen;
  for (const auto& p : model.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) params.push_back(p);
  }
  return params;
}

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.01); }

template <class M, class... Args>
M seeded(uint64_t seed, Args&&... args) {
  torch::manual_seed(seed);
  return M(std::forward<Args>(args)...);
}

struct TrainRun {
  std::vector<double> losses;  // global loss of each step
  Params params;               // full parameters after training
};

// Runs the forward of one step on `batch` (the global batch, or this rank's slice of it) and
// returns the loss to backpropagate.
using StepLoss = std::function<at::Tensor(const Batch& batch, int step)>;
// Called after each backward, before the optimizer step.
using AfterBackward = std::function<void(int step)>;

// kSteps of zero_grad, forward, backward, AdamW step. `sharded`: on this rank's slice, the
// loss averaged over ranks and the parameters gathered whole; otherwise on the global batch.
TrainRun train(torch::nn::Module& model, bool sharded, const StepLoss& step_loss,
               const AfterBackward& after_backward = nullptr) {
  torch::optim::AdamW opt(unique_parameters(model), adamw());
  TrainRun run;
  for (int step = 0; step < kSteps; ++step) {
    const Batch global = global_batch(step);
    const Batch batch = sharded ? local_batch(global) : global;
    opt.zero_grad();
    const at::Tensor loss = step_loss(batch, step);
    loss.backward();
    if (after_backward) after_backward(step);
    opt.step();
    run.losses.push_back(sharded ? global_mean(loss) : loss.item<double>());
  }
  run.params = sharded ? full_params(model) : own_params(model);
  return run;
}

// Per-step values (losses, gradient norms) within 1e-6 relative.
void expect_losses_match(const std::vector<double>& got, const std::vector<double>& expected,
                         const std::string& what = "loss") {
  ASSERT_EQ(got.size(), expected.size());
  for (std::size_t step = 0; step < expected.size(); ++step) {
    EXPECT_NEAR(got[step], expected[step], 1e-6 * std::abs(expected[step]))
        << what << " at step " << step;
  }
}

void expect_params_match(const Params& got, const Params& expected) {
  for (const auto& [name, value] : expected) {
    const auto it = got.find(name);
    if (it == got.end()) {
      ADD_FAILURE() << "no parameter " << name;
      continue;
    }
    EXPECT_EQ(it->second.sizes(), value.sizes()) << name;
    EXPECT_EQ(it->second.scalar_type(), value.scalar_type()) << name;
    if (it->second.sizes() == value.sizes()) {
      EXPECT_LT(rel_diff(it->second, value), 1e-5) << name;
    }
  }
}

void expect_matches(const TrainRun& got, const TrainRun& expected) {
  expect_losses_match(got.losses, expected.losses);
  expect_params_match(got.params, expected.params);
}

// `tensor` holds exactly the same values on every rank (collective).
void expect_same_on_every_rank(const at::Tensor& tensor, const std::string& name) {
  const at::Tensor values = tensor.detach().cpu().to(at::kDouble).contiguous();
  const std::vector<double> mine(values.data_ptr<double>(),
                                 values.data_ptr<double>() + values.numel());
  const auto all = mdist::allgather(mine);
  for (std::size_t r = 1; r < all.size(); ++r) {
    EXPECT_EQ(all[r], all[0]) << name << " on rank " << r << " differs from rank 0";
  }
}

// After a backward: parameters `frozen` names have no gradient at all; every other one has a
// gradient wherever this rank's shard holds real rows (`full` gives the full shapes).
void expect_grads(const torch::nn::Module& model, const Params& full,
                  const std::function<bool(const std::string&)>& frozen, int step) {
  for (const auto& p : model.named_parameters()) {
    if (frozen(p.key())) {
      EXPECT_FALSE(p.value().grad().defined()) << p.key() << " got a gradient at step " << step;
    } else if (owned_rows(full.at(p.key()).size(0)) > 0) {
      EXPECT_TRUE(p.value().grad().defined()) << p.key() << " has no gradient at step " << step;
    }
  }
}

StepLoss mse_of(const std::function<at::Tensor(const at::Tensor&)>& forward) {
  return [forward](const Batch& batch, int) { return torch::mse_loss(forward(batch.x), batch.y); };
}

template <class Holder>
StepLoss mse(Holder& model) {
  return mse_of([&model](const at::Tensor& x) { return model->forward(x); });
}

// Wraps mlp.h's Mlp as the other tests do: fc1 and fc2 as units of their own, then the root.
std::vector<mdist::FsdpHandle> wrap_mlp(Mlp& model, bool reshard_after_forward = true) {
  mdist::FullyShardOptions options;
  options.reshard_after_forward = reshard_after_forward;
  std::vector<mdist::FsdpHandle> units;
  units.push_back(mdist::fully_shard(*model->fc1, options));
  units.push_back(mdist::fully_shard(*model->fc2, options));
  units.push_back(mdist::fully_shard(*model, options));
  return units;
}

// ---------------------------------------------------------------------------------------------
// a. A unit called more than once per step.

// How `shared` runs twice in one forward: on two inputs, summed (weights shared across
// positions), or on its own output (a weight-tied recurrence).
enum class Reuse { kSum, kChain };

struct ReuseNetImpl : torch::nn::Module {
  explicit ReuseNetImpl(Reuse mode = Reuse::kSum) : reuse(mode) {
    inp = register_module("inp", torch::nn::Linear(8, 12));
    shared = register_module("shared", torch::nn::Linear(12, 12));
    head = register_module("head", torch::nn::Linear(12, 5));
  }
  at::Tensor forward(const at::Tensor& x) {
    return mdist::nn::hooked(*this, &ReuseNetImpl::body, x);
  }
  at::Tensor body(const at::Tensor& x) {
    const at::Tensor h = torch::tanh(mdist::nn::call(inp, x));
    at::Tensor y;
    if (reuse == Reuse::kSum) {
      y = mdist::nn::call(shared, h) + mdist::nn::call(shared, torch::sin(h));
    } else {
      y = mdist::nn::call(shared, torch::tanh(mdist::nn::call(shared, h)));
    }
    return mdist::nn::call(head, torch::tanh(y));
  }
  Reuse reuse;
  torch::nn::Linear inp{nullptr}, shared{nullptr}, head{nullptr};
};
TORCH_MODULE(ReuseNet);

std::vector<mdist::FsdpHandle> wrap_reuse(ReuseNet& model, bool reshard_after_forward = true) {
  mdist::FullyShardOptions options;
  options.reshard_after_forward = reshard_after_forward;
  std::vector<mdist::FsdpHandle> units;
  units.push_back(mdist::fully_shard(*model->inp, options));
  units.push_back(mdist::fully_shard(*model->shared, options));
  units.push_back(mdist::fully_shard(*model, options));
  return units;
}

class UnitCalledTwice : public ::testing::TestWithParam<std::tuple<Reuse, bool>> {};

TEST_P(UnitCalledTwice, MatchesSingleProcessTraining) {
  const Reuse reuse = std::get<0>(GetParam());
  const bool reshard_after_forward = std::get<1>(GetParam());
  ReuseNet reference = seeded<ReuseNet>(3, reuse);
  const TrainRun expected = train(*reference, false, mse(reference));

  ReuseNet model = seeded<ReuseNet>(3, reuse);
  const auto units = wrap_reuse(model, reshard_after_forward);
  const TrainRun got = train(*model, true, mse(model), [&](int step) {
    // Both uses of `shared` contributed to one reduced gradient, and nothing stays gathered.
    for (const auto& unit : units) EXPECT_FALSE(unit.is_unsharded()) << "step " << step;
  });
  expect_matches(got, expected);
}

INSTANTIATE_TEST_SUITE_P(
    Patterns, UnitCalledTwice,
    ::testing::Combine(::testing::Values(Reuse::kSum, Reuse::kChain), ::testing::Bool()),
    [](const auto& param_info) {
      return std::string(std::get<0>(param_info.param) == Reuse::kSum ? "Sum" : "Chain") +
             (std::get<1>(param_info.param) ? "Reshard" : "KeepFull");
    });

// ---------------------------------------------------------------------------------------------
// b. A no-grad forward of the whole model between a training forward and its backward (an
// evaluation pass, or logging); it must not disturb the pending backward.

class NoGradForwardBeforeBackward : public ::testing::TestWithParam<bool> {};

TEST_P(NoGradForwardBeforeBackward, MatchesSingleProcessTraining) {
  const bool reshard_after_forward = GetParam();
  // The training loss, and on the side an evaluation on other inputs under NoGradGuard.
  const auto with_eval = [](Mlp& model, std::vector<at::Tensor>& evals) -> StepLoss {
    return [&model, &evals](const Batch& batch, int) {
      const at::Tensor loss = torch::mse_loss(model->forward(batch.x), batch.y);
      {
        const at::NoGradGuard no_grad;
        evals.push_back(model->forward(batch.x * 0.5));
      }
      return loss;
    };
  };
  Mlp reference = seeded<Mlp>(7);
  std::vector<at::Tensor> expected_evals;
  const TrainRun expected = train(*reference, false, with_eval(reference, expected_evals));

  Mlp model = seeded<Mlp>(7);
  wrap_mlp(model, reshard_after_forward);
  std::vector<at::Tensor> evals;
  const TrainRun got = train(*model, true, with_eval(model, evals));
  expect_matches(got, expected);
  ASSERT_EQ(evals.size(), expected_evals.size());
  for (std::size_t step = 0; step < evals.size(); ++step) {
    EXPECT_FALSE(evals[step].requires_grad());
    EXPECT_LT(rel_diff(evals[step], local_rows(expected_evals[step])), 1e-5) << "step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(Patterns, NoGradForwardBeforeBackward, ::testing::Bool(),
                         [](const auto& param_info) {
                           return std::string(param_info.param ? "Reshard" : "KeepFull");
                         });

// ---------------------------------------------------------------------------------------------
// c. A frozen sub-module: no gradient, weights bit-identical, the rest trains as in one process.

// Four layers: l0 and l1 become units of their own, l2 and l3 belong to the root.
struct StackImpl : torch::nn::Module {
  StackImpl() {
    l0 = register_module("l0", torch::nn::Linear(8, 16));
    l1 = register_module("l1", torch::nn::Linear(16, 16));
    l2 = register_module("l2", torch::nn::Linear(16, 12));
    l3 = register_module("l3", torch::nn::Linear(12, 5));
  }
  at::Tensor forward(const at::Tensor& x) { return mdist::nn::hooked(*this, &StackImpl::body, x); }
  at::Tensor body(const at::Tensor& x) {
    at::Tensor h = torch::relu(mdist::nn::call(l0, x));
    h = torch::tanh(mdist::nn::call(l1, h));
    h = torch::tanh(mdist::nn::call(l2, h));
    return mdist::nn::call(l3, h);
  }
  torch::nn::Linear& layer(int index) {
    switch (index) {
      case 0:
        return l0;
      case 1:
        return l1;
      case 2:
        return l2;
      default:
        return l3;
    }
  }
  torch::nn::Linear l0{nullptr}, l1{nullptr}, l2{nullptr}, l3{nullptr};
};
TORCH_MODULE(Stack);

void freeze(torch::nn::Module& module) {
  for (auto& p : module.parameters()) p.requires_grad_(false);
}

enum class FreezeWhen { kBeforeWrapping, kShardsAfterWrapping };

// Which layer is frozen: 0 (a whole unit at the input, nothing flows back through it),
// 1 (a whole unit in the middle, gradients flow through it), 2 (inside the root, next to the
// trainable l3).
class FrozenSubmodule : public ::testing::TestWithParam<std::tuple<int, FreezeWhen>> {};

TEST_P(FrozenSubmodule, StaysBitIdenticalWithoutGradientsAndTheRestMatches) {
  const int frozen_layer = std::get<0>(GetParam());
  const FreezeWhen when = std::get<1>(GetParam());
  const std::string prefix = "l" + std::to_string(frozen_layer) + ".";
  const auto is_frozen = [&](const std::string& name) { return name.rfind(prefix, 0) == 0; };

  Stack reference = seeded<Stack>(9);
  const Params initial = own_params(*reference);
  freeze(*reference->layer(frozen_layer));
  const TrainRun expected = train(*reference, false, mse(reference));

  Stack model = seeded<Stack>(9);
  if (when == FreezeWhen::kBeforeWrapping) freeze(*model->layer(frozen_layer));
  mdist::fully_shard(*model->l0);
  mdist::fully_shard(*model->l1);
  mdist::fully_shard(*model);
  // After wrapping, the module's parameters() are its shards: freezing them freezes training.
  if (when == FreezeWhen::kShardsAfterWrapping) freeze(*model->layer(frozen_layer));

  const TrainRun got = train(*model, true, mse(model),
                             [&](int step) { expect_grads(*model, initial, is_frozen, step); });
  expect_matches(got, expected);
  for (const auto& [name, value] : initial) {
    if (!is_frozen(name)) continue;
    ASSERT_TRUE(got.params.contains(name)) << name;
    EXPECT_TRUE(torch::equal(got.params.at(name), value)) << name << " changed while frozen";
  }
}

INSTANTIATE_TEST_SUITE_P(Patterns, FrozenSubmodule,
                         ::testing::Combine(::testing::Values(0, 1, 2),
                                            ::testing::Values(FreezeWhen::kBeforeWrapping,
                                                              FreezeWhen::kShardsAfterWrapping)),
                         [](const auto& param_info) {
                           return "Layer" + std::to_string(std::get<0>(param_info.param)) +
                                  (std::get<1>(param_info.param) == FreezeWhen::kBeforeWrapping
                                       ? "BeforeWrapping"
                                       : "ShardsAfterWrapping");
                         });

// ---------------------------------------------------------------------------------------------
// d. LoRA: frozen base weights plus trainable low-rank adapters, in one unit per layer.

struct LoraLinearImpl : torch::nn::Module {
  static constexpr int64_t kRank = 2;
  static constexpr double kScale = 2.0;  // alpha / rank
  LoraLinearImpl(int64_t in, int64_t out) {
    base = register_module("base", torch::nn::Linear(in, out));
    lora_a = register_module("lora_a",
                             torch::nn::Linear(torch::nn::LinearOptions(in, kRank).bias(false)));
    lora_b = register_module("lora_b",
                             torch::nn::Linear(torch::nn::LinearOptions(kRank, out).bias(false)));
    // B starts at zero, so the adapted layer starts as the base layer (and A's first gradient
    // is exactly zero, in both runs).
    const at::NoGradGuard no_grad;
    lora_b->weight.zero_();
    freeze(*base);
  }
  at::Tensor forward(const at::Tensor& x) {
    return mdist::nn::hooked(*this, &LoraLinearImpl::body, x);
  }
  at::Tensor body(const at::Tensor& x) {
    return mdist::nn::call(base, x) + mdist::nn::call(lora_b, mdist::nn::call(lora_a, x)) * kScale;
  }
  torch::nn::Linear base{nullptr}, lora_a{nullptr}, lora_b{nullptr};
};
TORCH_MODULE(LoraLinear);

// Two adapted layers (units of their own) and a frozen head (the root's only parameters).
struct LoraMlpImpl : torch::nn::Module {
  LoraMlpImpl() {
    l0 = register_module("l0", LoraLinear(8, 16));
    l1 = register_module("l1", LoraLinear(16, 12));
    head = register_module("head", torch::nn::Linear(12, 5));
    freeze(*head);
  }
  at::Tensor forward(const at::Tensor& x) {
    return mdist::nn::hooked(*this, &LoraMlpImpl::body, x);
  }
  at::Tensor body(const at::Tensor& x) {
    const at::Tensor h = torch::tanh(mdist::nn::call(l0, x));
    return mdist::nn::call(head, torch::tanh(mdist::nn::call(l1, h)));
  }
  LoraLinear l0{nullptr}, l1{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(LoraMlp);

TEST(TrainingPatterns, LoraAdaptersMatchAndBaseWeightsStayBitIdentical) {
  const auto is_frozen = [](const std::string& name) {
    return name.find(".base.") != std::string::npos || name.rfind("head.", 0) == 0;
  };
  LoraMlp reference = seeded<LoraMlp>(11);
  const Params initial = own_params(*reference);
  const TrainRun expected = train(*reference, false, mse(reference));

  LoraMlp model = seeded<LoraMlp>(11);
  mdist::fully_shard(*model->l0);
  mdist::fully_shard(*model->l1);
  mdist::fully_shard(*model);
  const TrainRun got = train(*model, true, mse(model),
                             [&](int step) { expect_grads(*model, initial, is_frozen, step); });
  expect_matches(got, expected);
  for (const auto& [name, value] : initial) {
    if (is_frozen(name)) {
      ASSERT_TRUE(got.params.contains(name)) << name;
      EXPECT_TRUE(torch::equal(got.params.at(name), value)) << name << " changed while frozen";
    } else if (got.params.contains(name)) {
      // The adapters did train (B is no longer zero).
      EXPECT_FALSE(torch::equal(got.params.at(name), value)) << name;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// e. Parameters without a gradient in some steps, or used on some ranks only.

// `branch` runs only when use_branch is set.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    l0 = register_module("l0", torch::nn::Linear(8, 12));
    branch = register_module("branch", torch::nn::Linear(12, 12));
    head = register_module("head", torch::nn::Linear(12, 5));
  }
  at::Tensor forward(const at::Tensor& x) {
    return mdist::nn::hooked(*this, &BranchyImpl::body, x);
  }
  at::Tensor body(const at::Tensor& x) {
    at::Tensor h = torch::tanh(mdist::nn::call(l0, x));
    if (use_branch) h = h + torch::tanh(mdist::nn::call(branch, h));
    return mdist::nn::call(head, h);
  }
  bool use_branch = true;
  torch::nn::Linear l0{nullptr}, branch{nullptr}, head{nullptr};
};
TORCH_MODULE(Branchy);

// Whether the branch is a unit of its own (skipped entirely on odd steps, on every rank) or a
// module inside the root (whose other parameters do get gradients).
class UnusedOnOddSteps : public ::testing::TestWithParam<bool> {};

TEST_P(UnusedOnOddSteps, HasNoGradientThenAndTrainingMatches) {
  const bool branch_is_unit = GetParam();
  const auto step_loss = [](Branchy& model) -> StepLoss {
    return [&model](const Batch& batch, int step) {
      model->use_branch = step % 2 == 0;  // used on step 0, so the first pass sees it
      return torch::mse_loss(model->forward(batch.x), batch.y);
    };
  };
  Branchy reference = seeded<Branchy>(13);
  const Params initial = own_params(*reference);
  const TrainRun expected = train(*reference, false, step_loss(reference));

  Branchy model = seeded<Branchy>(13);
  mdist::fully_shard(*model->l0);
  if (branch_is_unit) mdist::fully_shard(*model->branch);
  mdist::fully_shard(*model);
  const TrainRun got = train(*model, true, step_loss(model), [&](int step) {
    // AdamW skips a parameter without a gradient, as it does in the reference: a zero
    // gradient instead would still decay the weights and move them by the momentum.
    expect_grads(
        *model, initial,
        [&](const std::string& name) { return step % 2 == 1 && name.rfind("branch.", 0) == 0; },
        step);
  });
  expect_matches(got, expected);
}

INSTANTIATE_TEST_SUITE_P(Patterns, UnusedOnOddSteps, ::testing::Bool(), [](const auto& param_info) {
  return std::string(param_info.param ? "BranchIsAUnit" : "BranchInsideTheRoot");
});

// `branch` refines only the rows listed in `branch_rows` (indices into the batch): a rank
// whose slice holds none of them never calls it.
struct PartialImpl : torch::nn::Module {
  PartialImpl() {
    l0 = register_module("l0", torch::nn::Linear(8, 12));
    branch = register_module("branch", torch::nn::Linear(12, 12));
    head = register_module("head", torch::nn::Linear(12, 5));
  }
  at::Tensor forward(const at::Tensor& x) {
    return mdist::nn::hooked(*this, &PartialImpl::body, x);
  }
  at::Tensor body(const at::Tensor& x) {
    at::Tensor h = torch::tanh(mdist::nn::call(l0, x));
    if (branch_rows.numel() > 0) {
      h = h.index_add(0, branch_rows,
                      torch::tanh(mdist::nn::call(branch, h.index_select(0, branch_rows))));
    }
    return mdist::nn::call(head, h);
  }
  at::Tensor branch_rows = torch::empty({0}, torch::kLong);
  torch::nn::Linear l0{nullptr}, branch{nullptr}, head{nullptr};
};
TORCH_MODULE(Partial);

TEST(TrainingPatterns, ParameterUsedOnSomeRanksOnlyGetsTheAveragedGradient) {
  // Step s refines global rows [3*(s%4), 3*(s%4)+3): with several ranks, only the one or two
  // whose slices hold them use the branch, and which ranks changes from step to step.
  const auto step_loss = [](Partial& model, bool sharded) -> StepLoss {
    return [&model, sharded](const Batch& batch, int step) {
      std::vector<int64_t> rows;
      for (int64_t row = 3 * (step % 4); row < 3 * (step % 4) + 3; ++row) {
        const int64_t local = sharded ? row - first_local_row() : row;
        if (local >= 0 && local < batch.x.size(0)) rows.push_back(local);
      }
      model->branch_rows =
          rows.empty() ? torch::empty({0}, torch::kLong) : torch::tensor(rows, torch::kLong);
      return torch::mse_loss(model->forward(batch.x), batch.y);
    };
  };
  Partial reference = seeded<Partial>(15);
  const Params initial = own_params(*reference);
  const TrainRun expected = train(*reference, false, step_loss(reference, false));

  Partial model = seeded<Partial>(15);
  mdist::fully_shard(*model->l0);
  mdist::fully_shard(*model);  // the branch belongs to the root, which runs on every rank
  const TrainRun got = train(*model, true, step_loss(model, true), [&](int step) {
    // Some rank used the branch, so every rank's shard of it has the averaged gradient.
    expect_grads(
        *model, initial, [](const std::string&) { return false; }, step);
  });
  expect_matches(got, expected);
}

// ---------------------------------------------------------------------------------------------
// f. Replicated parameters: a float router in a double model stays whole on every rank; its
// gradient is averaged over the ranks, so the replicas stay bit-identical.

struct RoutedBlockImpl : torch::nn::Module {
  RoutedBlockImpl() {
    proj = register_module("proj", torch::nn::Linear(8, 8));
    router = register_module("router", torch::nn::Linear(8, 1));
  }
  at::Tensor forward(const at::Tensor& x) {
    return mdist::nn::hooked(*this, &RoutedBlockImpl::body, x);
  }
  at::Tensor body(const at::Tensor& x) {
    const at::Tensor gate =
        torch::sigmoid(mdist::nn::call(router, x.to(at::kFloat))).to(x.scalar_type());
    return x + torch::tanh(mdist::nn::call(proj, x)) * gate;
  }
  torch::nn::Linear proj{nullptr}, router{nullptr};
};
TORCH_MODULE(RoutedBlock);

struct RoutedLayersImpl : torch::nn::Module {
  RoutedLayersImpl() {
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) layers->push_back(RoutedBlock());
  }
  torch::nn::ModuleList layers{nullptr};
};
TORCH_MODULE(RoutedLayers);

// model.layers.{0,1}.{proj,router}, head: the layout fsdp2_wrap detects. Double everywhere
// but the routers (float): double dominates by element count.
struct RoutedLmImpl : torch::nn::Module {
  RoutedLmImpl() {
    model = register_module("model", RoutedLayers());
    head = register_module("head", torch::nn::Linear(8, 5));
    to(at::kDouble);
    for (const auto& block : blocks()) block->router->to(at::kFloat);
  }
  std::vector<std::shared_ptr<RoutedBlockImpl>> blocks() const {
    std::vector<std::shared_ptr<RoutedBlockImpl>> list;
    for (std::size_t i = 0; i < model->layers->size(); ++i) {
      list.push_back(model->layers->ptr<RoutedBlockImpl>(i));
    }
    return list;
  }
  std::vector<at::Tensor> router_params() const {
    std::vector<at::Tensor> params;
    for (const auto& block : blocks()) {
      params.push_back(block->router->weight);
      params.push_back(block->router->bias);
    }
    return params;
  }
  at::Tensor forward(const at::Tensor& x) {
    return mdist::nn::hooked(*this, &RoutedLmImpl::body, x);
  }
  at::Tensor body(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto block : blocks()) h = mdist::nn::call(block, h);
    return mdist::nn::call(head, h);
  }
  RoutedLayers model{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(RoutedLm);

enum class Replication {
  kIgnoredParams,       // layers and root wrapped with ignored_params = the routers'
  kReplicateOnlyUnits,  // each router also wrapped as a unit of its own, all of it ignored
  kFsdp2Wrap,           // fsdp2_wrap finds the off-dtype routers itself
};

class ReplicatedParameters : public ::testing::TestWithParam<Replication> {};

TEST_P(ReplicatedParameters, TrainAsInOneProcessAndStayIdenticalAcrossRanks) {
  const Replication replication = GetParam();
  const auto step_loss = [](RoutedLm& lm) -> StepLoss {
    return [&lm](const Batch& batch, int) {
      return torch::mse_loss(lm->forward(batch.x.to(at::kDouble)), batch.y.to(at::kDouble));
    };
  };
  // Clipped to a norm below the gradients' so that clipping changes every step: a replicated
  // gradient counted on every rank, or not at all, would give another norm and other weights.
  constexpr double kMaxNorm = 0.05;
  RoutedLm reference = seeded<RoutedLm>(17);
  std::vector<double> expected_norms;
  const TrainRun expected = train(*reference, false, step_loss(reference), [&](int) {
    expected_norms.push_back(
        torch::nn::utils::clip_grad_norm_(unique_parameters(*reference), kMaxNorm));
  });

  RoutedLm lm = seeded<RoutedLm>(17);
  if (replication == Replication::kFsdp2Wrap) {
    ::testing::internal::CaptureStderr();
    const auto layers = mdist::fsdp2_wrap(*lm);
    const std::string warning = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(layers.size(), 2u);
    if (mdist::is_master()) {
      EXPECT_EQ(std::count(warning.begin(), warning.end(), '\n'), 1) << warning;
      EXPECT_THAT(warning, HasSubstr("stay replicated"));
      EXPECT_THAT(warning, HasSubstr("model.layers.0.router.weight (float32)"));
    } else {
      EXPECT_EQ(warning, "");
    }
  } else {
    mdist::FullyShardOptions options;
    for (const auto& block : lm->blocks()) {
      options.ignored_params = {block->router->weight, block->router->bias};
      if (replication == Replication::kReplicateOnlyUnits) {
        mdist::fully_shard(*block->router, options);  // a unit with nothing to shard
      }
      mdist::fully_shard(*block, options);
    }
    options.ignored_params = lm->router_params();
    mdist::fully_shard(*lm, options);
  }
  for (const auto& block : lm->blocks()) {
    EXPECT_EQ(block->router->weight.sizes(), (c10::IntArrayRef{1, 8}));
    EXPECT_EQ(block->router->weight.scalar_type(), at::kFloat);
  }

  std::vector<double> norms;
  const TrainRun got = train(*lm, true, step_loss(lm), [&](int step) {
    for (const auto& router : lm->router_params()) {
      EXPECT_TRUE(router.grad().defined()) << "step " << step;
    }
    norms.push_back(mdist::clip_grad_norm_(*lm, kMaxNorm));
  });
  expect_matches(got, expected);
  expect_losses_match(norms, expected_norms, "gradient norm");
  EXPECT_GT(expected_norms.front(), kMaxNorm);
  const auto blocks = lm->blocks();
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const std::string name = "model.layers." + std::to_string(i) + ".router";
    EXPECT_EQ(blocks[i]->router->weight.sizes(), (c10::IntArrayRef{1, 8})) << name;
    expect_same_on_every_rank(blocks[i]->router->weight, name + ".weight");
    expect_same_on_every_rank(blocks[i]->router->bias, name + ".bias");
  }
}

INSTANTIATE_TEST_SUITE_P(Patterns, ReplicatedParameters,
                         ::testing::Values(Replication::kIgnoredParams,
                                           Replication::kReplicateOnlyUnits,
                                           Replication::kFsdp2Wrap),
                         [](const auto& param_info) {
                           switch (param_info.param) {
                             case Replication::kIgnoredParams:
                               return std::string("IgnoredParams");
                             case Replication::kReplicateOnlyUnits:
                               return std::string("ReplicateOnlyUnits");
                             default:
                               return std::string("Fsdp2Wrap");
                           }
                         });

// ---------------------------------------------------------------------------------------------
// g. fsdp2_wrap(shard_root=false): the root's own parameters (embeddings, final norm, head)
// stay whole and replicated, their gradients averaged over the ranks.

using mdist::testing::HfShapedLm;

// Next-token loss over the batch's token ids: 5 inputs, the 5 following tokens as targets.
template <class Holder>
StepLoss next_token_loss(Holder& lm, int64_t vocab) {
  return [&lm, vocab](const Batch& batch, int) {
    const at::Tensor logits = lm->forward(batch.ids.narrow(1, 0, 5));
    return torch::cross_entropy_loss(logits.reshape({-1, vocab}),
                                     batch.ids.narrow(1, 1, 5).reshape({-1}));
  };
}

TEST(TrainingPatterns, Fsdp2WrapWithoutShardingTheRootKeepsItReplicated) {
  const std::vector<std::string> root_params = {"model.embed_tokens.weight", "model.norm.weight",
                                                "model.norm.bias", "lm_head.weight",
                                                "lm_head.bias"};
  HfShapedLm reference = seeded<HfShapedLm>(23);
  const TrainRun expected = train(*reference, false, next_token_loss(reference, 32));

  HfShapedLm lm = seeded<HfShapedLm>(23);
  const auto layers = mdist::fsdp2_wrap(*lm, /*shard_root=*/false);
  EXPECT_EQ(layers.size(), 3u);
  for (const auto& name : root_params) {
    EXPECT_EQ(lm->named_parameters()[name].sizes(), expected.params.at(name).sizes()) << name;
  }
  const TrainRun got = train(*lm, true, next_token_loss(lm, 32));
  expect_matches(got, expected);
  for (const auto& name : root_params) {
    const at::Tensor param = lm->named_parameters()[name];
    EXPECT_EQ(param.sizes(), expected.params.at(name).sizes()) << name << " is not whole";
    expect_same_on_every_rank(param, name);
  }
}

// ---------------------------------------------------------------------------------------------
// h. Tied weights: the head's weight is the embedding's tensor, registered under both modules.

// libtorch's register_parameter refuses a name that is already registered, and the parameter
// table is protected; a derived class may name it through a member pointer.
struct ParameterTable : torch::nn::Module {
  static at::Tensor& entry(torch::nn::Module& module, const std::string& name) {
    return (module.*(&ParameterTable::parameters_))[name];
  }
};

struct TiedLmImpl : torch::nn::Module {
  TiedLmImpl() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, 8));
    mid = register_module("mid", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) mid->push_back(torch::nn::Linear(8, 8));
    head = register_module("head", torch::nn::Linear(8, kVocab));
    // Tie: the head's member and its registered parameter are both the embedding's tensor.
    head->weight = embed->weight;
    ParameterTable::entry(*head, "weight") = embed->weight;
  }
  at::Tensor forward(const at::Tensor& ids) {
    return mdist::nn::hooked(*this, &TiedLmImpl::body, ids);
  }
  at::Tensor body(const at::Tensor& ids) {
    at::Tensor h = mdist::nn::call(embed, ids);
    for (std::size_t i = 0; i < mid->size(); ++i) {
      auto layer = mid->ptr<torch::nn::LinearImpl>(i);
      h = torch::tanh(mdist::nn::call(layer, h));
    }
    return mdist::nn::call(head, h);
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList mid{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TiedLm);

// Whether the mid layers are units of their own (the tied pair is then the root's).
class TiedWeights : public ::testing::TestWithParam<bool> {};

TEST_P(TiedWeights, AreManagedOnceAndTrainAsInOneProcess) {
  const bool wrap_layers = GetParam();
  TiedLm reference = seeded<TiedLm>(19);
  ASSERT_TRUE(reference->head->weight.is_same(reference->embed->weight));
  ASSERT_TRUE(reference->head->named_parameters(false)["weight"].is_same(reference->embed->weight));
  // Clipped below the gradients' norm: a tied gradient counted twice would change the weights.
  constexpr double kMaxNorm = 0.1;
  std::vector<double> expected_norms;
  const TrainRun expected = train(*reference, false, next_token_loss(reference, kVocab), [&](int) {
    expected_norms.push_back(
        torch::nn::utils::clip_grad_norm_(unique_parameters(*reference), kMaxNorm));
  });

  TiedLm lm = seeded<TiedLm>(19);
  if (wrap_layers) {
    for (const auto& layer : *lm->mid) mdist::fully_shard(*layer);
  }
  const auto root = mdist::fully_shard(*lm);
  const auto names = root.managed_parameter_names();
  EXPECT_EQ(std::count(names.begin(), names.end(), "embed.weight") +
                std::count(names.begin(), names.end(), "head.weight"),
            1)
      << ::testing::PrintToString(names);
  // The tied weight, head.bias, and without wrapped layers their weights and biases.
  EXPECT_EQ(names.size(), wrap_layers ? 2u : 6u) << ::testing::PrintToString(names);
  // One shard under both names, which the optimizer steps once.
  EXPECT_TRUE(lm->head->named_parameters(false)["weight"].is_same(
      lm->embed->named_parameters(false)["weight"]));

  std::vector<double> norms;
  const TrainRun got = train(*lm, true, next_token_loss(lm, kVocab),
                             [&](int) { norms.push_back(mdist::clip_grad_norm_(*lm, kMaxNorm)); });
  expect_matches(got, expected);
  expect_losses_match(norms, expected_norms, "gradient norm");
  EXPECT_GT(expected_norms.front(), kMaxNorm);
  ASSERT_TRUE(got.params.contains("head.weight"));
  ASSERT_TRUE(got.params.contains("embed.weight"));
  EXPECT_TRUE(torch::equal(got.params.at("head.weight"), got.params.at("embed.weight")));
}

INSTANTIATE_TEST_SUITE_P(Patterns, TiedWeights, ::testing::Bool(), [](const auto& param_info) {
  return std::string(param_info.param ? "LayersAndRoot" : "RootOnly");
});

// ---------------------------------------------------------------------------------------------
// i. Wrapping a child after its parent is refused, and the refusal changes nothing.

TEST(TrainingPatterns, WrappingAChildAfterItsParentFailsAndLeavesNothingBehind) {
  Mlp reference = seeded<Mlp>(21);
  const TrainRun expected = train(*reference, false, mse(reference));

  Mlp model = seeded<Mlp>(21);
  const auto root = mdist::fully_shard(*model);
  const std::string error = error_of([&] { mdist::fully_shard(*model->fc1); });
  EXPECT_THAT(error, HasSubstr("is already managed by"));
  EXPECT_THAT(error, HasSubstr("wrap inner modules before their parents"));
  EXPECT_FALSE(mdist::fsdp_handle(*model->fc1).has_value());
  EXPECT_EQ(root.managed_parameter_names().size(), 6u);
  const TrainRun got = train(*model, true, mse(model));
  expect_matches(got, expected);
}

// ---------------------------------------------------------------------------------------------
// j. In-place ops on a unit's outputs (residual adds written as +=, add_).

struct InPlaceImpl : torch::nn::Module {
  InPlaceImpl() {
    l1 = register_module("l1", torch::nn::Linear(8, 8));
    l2 = register_module("l2", torch::nn::Linear(8, 8));
    head = register_module("head", torch::nn::Linear(8, 5));
  }
  at::Tensor forward(const at::Tensor& x) {
    return mdist::nn::hooked(*this, &InPlaceImpl::body, x);
  }
  at::Tensor body(const at::Tensor& x) {
    at::Tensor h = mdist::nn::call(l1, x);
    h += x;  // in place on l1's output
    h = torch::tanh(h);
    const at::Tensor residual = h;
    h = mdist::nn::call(l2, h);
    h.add_(residual);  // in place on l2's output
    return mdist::nn::call(head, torch::tanh(h));
  }
  torch::nn::Linear l1{nullptr}, l2{nullptr}, head{nullptr};
};
TORCH_MODULE(InPlace);

TEST(TrainingPatterns, InPlaceAddOnUnitOutputsMatches) {
  InPlace reference = seeded<InPlace>(25);
  const TrainRun expected = train(*reference, false, mse(reference));

  InPlace model = seeded<InPlace>(25);
  mdist::fully_shard(*model->l1);
  mdist::fully_shard(*model->l2);
  mdist::fully_shard(*model);
  const TrainRun got = train(*model, true, mse(model));
  expect_matches(got, expected);
}

// ---------------------------------------------------------------------------------------------
// k. A step that throws, in forward or in backward, then zero_grad and carrying on: the
// successful steps give exactly the reference's numbers, as if the failed ones never happened.

// Throws in its backward: stands for a failing custom autograd function.
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    throw std::runtime_error("backward failed on purpose");
  }
};

void throwing_hook(const at::Tensor&) { throw std::runtime_error("backward failed on purpose"); }

struct FragileLayerImpl : torch::nn::Module {
  FragileLayerImpl() { fc = register_module("fc", torch::nn::Linear(16, 12)); }
  at::Tensor forward(const at::Tensor& x) {
    return mdist::nn::hooked(*this, &FragileLayerImpl::body, x);
  }
  at::Tensor body(const at::Tensor& x) {
    at::Tensor pre = mdist::nn::call(fc, x);
    if (throw_in_backward) pre = ThrowInBackward::apply(pre);
    const at::Tensor out = torch::tanh(pre);
    // After the layer's parameters were gathered and used: a graph half built.
    if (throw_in_forward) throw std::runtime_error("forward failed on purpose");
    return out;
  }
  bool throw_in_forward = false;
  bool throw_in_backward = false;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(FragileLayer);

// l0 and l1 are units of their own; l2 is the root's.
struct FragileNetImpl : torch::nn::Module {
  FragileNetImpl() {
    l0 = register_module("l0", torch::nn::Linear(8, 16));
    l1 = register_module("l1", FragileLayer());
    l2 = register_module("l2", torch::nn::Linear(12, 5));
  }
  at::Tensor forward(const at::Tensor& x) {
    return mdist::nn::hooked(*this, &FragileNetImpl::body, x);
  }
  at::Tensor body(const at::Tensor& x) {
    at::Tensor h = torch::relu(mdist::nn::call(l0, x));
    h = mdist::nn::call(l1, h);
    // Fires once the root's backward (l2) ran, before l1's and l0's.
    if (throw_between_units) h.register_hook(throwing_hook);
    return mdist::nn::call(l2, h);
  }
  bool throw_between_units = false;
  torch::nn::Linear l0{nullptr};
  FragileLayer l1{nullptr};
  torch::nn::Linear l2{nullptr};
};
TORCH_MODULE(FragileNet);

// Failures to inject, each before the successful run of one step, on every rank alike.
enum Failure : unsigned {
  kInsideUnitBackward = 1,  // step 1: a custom function in l1 throws after l1 was gathered
  kForwardBody = 2,         // step 2: l1's body throws
  kAtLossInput = 4,         // step 3: a hook on the model's output throws, before any unit
  kBetweenUnits = 8,        // step 4: a hook on l1's output throws, after the root's backward
};

class FailedStep : public ::testing::TestWithParam<unsigned> {};

TEST_P(FailedStep, LeavesNothingBehindForTheNextStep) {
  const unsigned failures = GetParam();
  FragileNet reference = seeded<FragileNet>(27);
  const TrainRun expected = train(*reference, false, mse(reference));

  FragileNet model = seeded<FragileNet>(27);
  std::vector<mdist::FsdpHandle> units = {
      mdist::fully_shard(*model->l0), mdist::fully_shard(*model->l1), mdist::fully_shard(*model)};
  torch::optim::AdamW opt(unique_parameters(*model), adamw());
  TrainRun got;
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = local_batch(global_batch(step));
    if ((failures & kInsideUnitBackward) && step == 1) {
      model->l1->throw_in_backward = true;
      const at::Tensor loss = torch::mse_loss(model->forward(batch.x), batch.y);
      model->l1->throw_in_backward = false;
      EXPECT_THROW(loss.backward(), std::exception);
      opt.zero_grad();
    }
    if ((failures & kForwardBody) && step == 2) {
      model->l1->throw_in_forward = true;
      EXPECT_THROW(model->forward(batch.x), std::runtime_error);
      model->l1->throw_in_forward = false;
      opt.zero_grad();
    }
    if ((failures & kAtLossInput) && step == 3) {
      const at::Tensor out = model->forward(batch.x);
      out.register_hook(throwing_hook);  // this step's graph only
      const at::Tensor loss = torch::mse_loss(out, batch.y);
      EXPECT_THROW(loss.backward(), std::exception);
      opt.zero_grad();
    }
    if ((failures & kBetweenUnits) && step == 4) {
      model->throw_between_units = true;
      const at::Tensor loss = torch::mse_loss(model->forward(batch.x), batch.y);
      model->throw_between_units = false;
      EXPECT_THROW(loss.backward(), std::exception);
      opt.zero_grad();
    }
    opt.zero_grad();
    const at::Tensor loss = torch::mse_loss(model->forward(batch.x), batch.y);
    loss.backward();
    opt.step();
    got.losses.push_back(global_mean(loss));
  }
  for (const auto& unit : units) EXPECT_FALSE(unit.is_unsharded());
  got.params = full_params(*model);
  expect_matches(got, expected);
}

INSTANTIATE_TEST_SUITE_P(Patterns, FailedStep,
                         ::testing::Values(kInsideUnitBackward, kForwardBody, kAtLossInput,
                                           kBetweenUnits,
                                           kInsideUnitBackward | kForwardBody | kAtLossInput |
                                               kBetweenUnits),
                         [](const auto& param_info) {
                           std::string name;
                           if (param_info.param & kInsideUnitBackward) name += "InsideUnitBackward";
                           if (param_info.param & kForwardBody) name += "ForwardBody";
                           if (param_info.param & kAtLossInput) name += "AtLossInput";
                           if (param_info.param & kBetweenUnits) name += "BetweenUnits";
                           return name;
                         });

// ---------------------------------------------------------------------------------------------
// l. Several wrapped models in one process, each its own root.

TEST(TrainingPatterns, DistillationFromAForwardOnlyTeacher) {
  // The student learns the targets and the teacher's outputs; the teacher runs under
  // NoGradGuard between the student's forward and its backward.
  const auto distill = [](Mlp& student, Mlp& teacher) -> StepLoss {
    return [&student, &teacher](const Batch& batch, int) {
      const at::Tensor out = student->forward(batch.x);
      at::Tensor target;
      {
        const at::NoGradGuard no_grad;
        target = teacher->forward(batch.x);
      }
      return torch::mse_loss(out, target) + torch::mse_loss(out, batch.y);
    };
  };
  Mlp reference_teacher = seeded<Mlp>(41);
  Mlp reference_student = seeded<Mlp>(42);
  const TrainRun expected =
      train(*reference_student, false, distill(reference_student, reference_teacher));

  Mlp teacher = seeded<Mlp>(41);
  Mlp student = seeded<Mlp>(42);
  const Params teacher_initial = own_params(*teacher);
  const auto teacher_units = wrap_mlp(teacher);
  wrap_mlp(student);
  const TrainRun got = train(*student, true, distill(student, teacher), [&](int step) {
    for (const auto& p : teacher->parameters()) {
      EXPECT_FALSE(p.grad().defined()) << "teacher gradient at step " << step;
    }
    for (const auto& unit : teacher_units) EXPECT_FALSE(unit.is_unsharded()) << step;
  });
  expect_matches(got, expected);
  const Params teacher_final = full_params(*teacher);
  for (const auto& [name, value] : teacher_initial) {
    ASSERT_TRUE(teacher_final.contains(name)) << name;
    EXPECT_TRUE(torch::equal(teacher_final.at(name), value)) << "teacher's " << name;
  }
}

TEST(TrainingPatterns, TwoStudentsInterleaved) {
  // Two different models (an Mlp, and a ReuseNet whose `shared` unit runs twice per step),
  // different targets, each its own root with its own optimizer: forward A, forward B,
  // backward A, backward B.
  const auto loss_a = [](Mlp& a) -> StepLoss { return mse(a); };
  const auto loss_b = [](ReuseNet& b) -> StepLoss {
    return [&b](const Batch& batch, int) {
      return torch::mse_loss(b->forward(batch.x), batch.y * -0.5);
    };
  };
  Mlp reference_a = seeded<Mlp>(43);
  ReuseNet reference_b = seeded<ReuseNet>(44, Reuse::kSum);
  const TrainRun expected_a = train(*reference_a, false, loss_a(reference_a));
  const TrainRun expected_b = train(*reference_b, false, loss_b(reference_b));

  Mlp a = seeded<Mlp>(43);
  ReuseNet b = seeded<ReuseNet>(44, Reuse::kSum);
  wrap_mlp(a);
  wrap_reuse(b);
  const StepLoss step_a = loss_a(a);
  const StepLoss step_b = loss_b(b);
  torch::optim::AdamW opt_a(unique_parameters(*a), adamw());
  torch::optim::AdamW opt_b(unique_parameters(*b), adamw());
  TrainRun got_a, got_b;
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = local_batch(global_batch(step));
    opt_a.zero_grad();
    opt_b.zero_grad();
    const at::Tensor la = step_a(batch, step);
    const at::Tensor lb = step_b(batch, step);
    la.backward();
    lb.backward();
    opt_a.step();
    opt_b.step();
    got_a.losses.push_back(global_mean(la));
    got_b.losses.push_back(global_mean(lb));
  }
  got_a.params = full_params(*a);
  got_b.params = full_params(*b);
  {
    SCOPED_TRACE("student A");
    expect_matches(got_a, expected_a);
  }
  {
    SCOPED_TRACE("student B");
    expect_matches(got_b, expected_b);
  }
}

// ---------------------------------------------------------------------------------------------
// m. Loading: load_state_dict_by_rows from a RowSource, and loaders leaving units resharded.

// fc1 (a unit of its own), fc2 and a buffer (the root's).
struct BufferedImpl : torch::nn::Module {
  BufferedImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 5));
    scale = register_buffer("scale", torch::ones({5}));
  }
  at::Tensor forward(const at::Tensor& x) {
    return mdist::nn::hooked(*this, &BufferedImpl::body, x);
  }
  at::Tensor body(const at::Tensor& x) {
    return mdist::nn::call(fc2, torch::relu(mdist::nn::call(fc1, x))) * scale;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(Buffered);

std::vector<mdist::FsdpHandle> wrap_buffered(Buffered& model) {
  return {mdist::fully_shard(*model->fc1), mdist::fully_shard(*model)};
}

// The checkpoint the loading tests read: another initialisation, and a buffer that differs
// from the default.
Buffered checkpoint_model() {
  Buffered model = seeded<Buffered>(77);
  model->scale.copy_(torch::linspace(0.5, 1.5, 5));
  return model;
}

Params tensors_of(const torch::nn::Module& model) {
  Params tensors = own_params(model);
  for (const auto& b : model.named_buffers()) tensors[b.key()] = b.value().detach().clone();
  return tensors;
}

struct RowRead {
  std::string name;
  int64_t first_row = 0;
  int64_t rows = 0;
};

// A RowSource over tensors in memory; records what was read.
mdist::RowSource source_of(const Params& tensors, std::vector<RowRead>* reads = nullptr) {
  mdist::RowSource source;
  source.keys = [tensors] {
    std::vector<std::string> keys;
    for (const auto& [name, value] : tensors) keys.push_back(name);
    return keys;
  };
  source.shape = [tensors](const std::string& name) { return tensors.at(name).sizes().vec(); };
  source.read = [tensors, reads](const std::string& name, int64_t first_row, int64_t rows) {
    if (reads) reads->push_back({name, first_row, rows});
    const at::Tensor& whole = tensors.at(name);
    return rows < 0 ? whole.clone() : whole.narrow(0, first_row, rows).clone();
  };
  return source;
}

TEST(Loading, ByRowsReadsOnlyOwnedRowsAndLoadsBuffers) {
  Buffered source = checkpoint_model();
  const Params checkpoint = tensors_of(*source);
  Buffered model = seeded<Buffered>(5);
  auto units = wrap_buffered(model);
  for (auto& unit : units) unit.unshard();  // full parameters that loading makes stale

  std::vector<RowRead> reads;
  mdist::load_state_dict_by_rows(*model, source_of(checkpoint, &reads));
  for (const auto& unit : units) EXPECT_FALSE(unit.is_unsharded());
  // A sharded parameter is read only in this rank's rows, and all of them.
  for (const std::string name : {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}) {
    const int64_t rows = checkpoint.at(name).size(0);
    const int64_t chunk = (rows + mdist::size() - 1) / mdist::size();
    const int64_t first = mdist::rank() * chunk;
    int64_t total = 0;
    for (const auto& request : reads) {
      if (request.name != name) continue;
      EXPECT_GE(request.first_row, first) << name;
      EXPECT_LE(request.first_row + request.rows, first + owned_rows(rows)) << name;
      total += request.rows;
    }
    EXPECT_EQ(total, owned_rows(rows)) << name;
  }

  const at::Tensor x = local_rows(global_batch(0).x);
  {
    // The next forward gathers the loaded values, not the stale ones.
    const at::NoGradGuard no_grad;
    EXPECT_LT(rel_diff(model->forward(x), source->forward(x)), 1e-6);
  }
  const Params loaded = full_params(*model);
  for (const auto& [name, value] : checkpoint) {
    ASSERT_TRUE(loaded.contains(name)) << name;
    EXPECT_TRUE(torch::equal(loaded.at(name), value)) << name;
  }
}

TEST(Loading, ByRowsNamesBadCheckpoints) {
  Buffered model = seeded<Buffered>(5);
  wrap_buffered(model);
  const Params checkpoint = tensors_of(*checkpoint_model());
  const auto load = [&](const Params& tensors) {
    return error_of([&] { mdist::load_state_dict_by_rows(*model, source_of(tensors)); });
  };

  Params longer = checkpoint;  // extra rows: every rank's own rows could be read, still wrong
  longer["fc1.weight"] = torch::randn({20, 8});
  const std::string too_long = load(longer);
  EXPECT_THAT(too_long, HasSubstr("size mismatch for 'fc1.weight'"));
  EXPECT_THAT(too_long, HasSubstr("[20, 8]"));
  EXPECT_THAT(too_long, HasSubstr("[16, 8]"));

  Params shorter = checkpoint;
  shorter["fc1.weight"] = torch::randn({12, 8});
  EXPECT_THAT(load(shorter), HasSubstr("size mismatch for 'fc1.weight'"));

  Params extra = checkpoint;
  extra["fc9.weight"] = torch::zeros({3, 3});
  EXPECT_THAT(load(extra), HasSubstr("unexpected key 'fc9.weight'"));

  Params missing = checkpoint;
  missing.erase("fc2.bias");
  EXPECT_THAT(load(missing), HasSubstr("missing key 'fc2.bias'"));

  Params missing_buffer = checkpoint;
  missing_buffer.erase("scale");
  EXPECT_THAT(load(missing_buffer), HasSubstr("missing key 'scale'"));

  // Every check comes before any value is loaded: the refused checkpoints changed nothing,
  // even the one whose first tensors were fine.
  const Params after = full_params(*model);
  const Params before = full_params(*seeded<Buffered>(5));
  for (const auto& [name, value] : before) {
    ASSERT_TRUE(after.contains(name)) << name;
    EXPECT_TRUE(torch::equal(after.at(name), value)) << name << " changed";
  }
}

class LoadLeavesUnitsResharded : public ::testing::TestWithParam<bool> {};  // full or sharded

TEST_P(LoadLeavesUnitsResharded, AndTheNextForwardUsesTheLoadedValues) {
  const bool full = GetParam();
  Buffered source = checkpoint_model();
  wrap_buffered(source);
  const auto full_dict = mdist::full_state_dict(*source, {.rank0_only = false, .cpu = true});
  const auto sharded_dict = mdist::sharded_state_dict(*source);

  Buffered model = seeded<Buffered>(5);
  auto units = wrap_buffered(model);
  for (auto& unit : units) unit.unshard();
  if (full) {
    mdist::load_full_state_dict(*model, full_dict);
  } else {
    mdist::load_sharded_state_dict(*model, sharded_dict);
  }
  for (const auto& unit : units) EXPECT_FALSE(unit.is_unsharded());
  const at::Tensor x = local_rows(global_batch(0).x);
  const at::NoGradGuard no_grad;
  EXPECT_LT(rel_diff(model->forward(x), source->forward(x)), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Patterns, LoadLeavesUnitsResharded, ::testing::Bool(),
                         [](const auto& param_info) {
                           return std::string(param_info.param ? "Full" : "Sharded");
                         });

// ---------------------------------------------------------------------------------------------
// n. Gradient accumulation without sync over two micro-batches, with a unit run twice in each.

class AccumulationWithoutSync : public ::testing::TestWithParam<bool> {};  // keep gathered

TEST_P(AccumulationWithoutSync, WithAUnitRunTwicePerMicroBatchMatchesOneGlobalStep) {
  const bool keep_gathered = GetParam();
  ReuseNet reference = seeded<ReuseNet>(29, Reuse::kSum);
  const TrainRun expected = train(*reference, false, mse(reference));

  ReuseNet model = seeded<ReuseNet>(29, Reuse::kSum);
  auto units = wrap_reuse(model);
  torch::optim::AdamW opt(unique_parameters(*model), adamw());
  TrainRun got;
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = local_batch(global_batch(step));
    const int64_t n = batch.x.size(0);
    const int64_t a = n / 2;  // micro-batches of a and n - a samples (n >= 3 on up to 4 ranks)
    const double weight = static_cast<double>(a) / n;
    opt.zero_grad();
    for (auto& unit : units) {
      unit.set_requires_gradient_sync(false);
      unit.set_reshard_after_backward(!keep_gathered);
    }
    const at::Tensor first =
        torch::mse_loss(model->forward(batch.x.narrow(0, 0, a)), batch.y.narrow(0, 0, a)) * weight;
    first.backward();
    // Nothing reduced yet: the shards have no gradient.
    for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined()) << step;
    for (auto& unit : units) {
      unit.set_requires_gradient_sync(true);
      unit.set_reshard_after_backward(true);
    }
    const at::Tensor second =
        torch::mse_loss(model->forward(batch.x.narrow(0, a, n - a)), batch.y.narrow(0, a, n - a)) *
        (1 - weight);
    second.backward();
    for (const auto& unit : units) EXPECT_FALSE(unit.is_unsharded()) << step;
    opt.step();
    got.losses.push_back(global_mean(first.detach() + second.detach()));
  }
  got.params = full_params(*model);
  expect_matches(got, expected);
}

INSTANTIATE_TEST_SUITE_P(Patterns, AccumulationWithoutSync, ::testing::Bool(),
                         [](const auto& param_info) {
                           return std::string(param_info.param ? "KeepGathered" : "Reshard");
                         });

}  // namespace
