// fully_shard against an un-sharded reference trained in one process on the global batch
// (run by mdistrun with 1, 2, 3 and 4 ranks; 3 ranks exercises uneven padding).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/mdist.h"
#include "tests/fsdp/mlp.h"
#include "tests/fsdp/mlp_reference.h"
#include "tests/support/error_of.h"

namespace {

using mdist::testing::Mlp;
using ::testing::HasSubstr;

using mdist::testing::adamw;
using mdist::testing::Data;
using mdist::testing::global_batch;
using mdist::testing::kGlobalBatch;
using mdist::testing::kSteps;
using mdist::testing::local_batch;
using mdist::testing::rel_diff;
using mdist::testing::seeded_model;
using mdist::testing::Trace;
using mdist::testing::train_reference;

enum class Wrap { kLayersAndRoot, kRootOnly };

Trace train_sharded(Wrap wrap, bool reshard_after_forward, bool check_memory) {
  Mlp model = seeded_model();
  mdist::FullyShardOptions options;
  options.reshard_after_forward = reshard_after_forward;
  std::vector<mdist::FsdpHandle> layers;
  if (wrap == Wrap::kLayersAndRoot) {
    for (auto* layer : {model->fc1.ptr().get(), model->fc2.ptr().get()}) {
      layers.push_back(mdist::fully_shard(*layer, options));
    }
  }
  const mdist::FsdpHandle root = mdist::fully_shard(*model, options);
  EXPECT_TRUE(mdist::is_fsdp2_model(*model));

  torch::optim::AdamW opt(model->parameters(), adamw());
  Trace trace;
  for (int step = 0; step < kSteps; ++step) {
    const Data d = local_batch(step);
    opt.zero_grad();
    const at::Tensor loss = torch::mse_loss(model->forward(d.x), d.y);
    if (check_memory) {
      for (const auto& layer : layers) EXPECT_EQ(layer.is_unsharded(), !reshard_after_forward);
      if (reshard_after_forward) {
        EXPECT_EQ(model->fc1->weight.storage().nbytes(), 0u) << "full weight kept after forward";
      }
    }
    loss.backward();
    opt.step();
    if (check_memory) {
      // After backward no unit holds its full parameters.
      for (const auto& layer : layers) EXPECT_FALSE(layer.is_unsharded());
      EXPECT_FALSE(root.is_unsharded());
      for (auto* linear : {model->fc1.get(), model->fc2.get(), model->fc3.get()}) {
        EXPECT_EQ(linear->weight.storage().nbytes(), 0u);
        EXPECT_EQ(linear->bias.storage().nbytes(), 0u);
      }
    }
    // The global loss: the mean of the ranks' means over equal local batches.
    trace.losses.push_back(mdist::allreduce(loss.item<double>()) / mdist::size());
  }
  // Gather the full parameters to compare them with the reference.
  for (auto& layer : layers) layer.unshard();
  {
    mdist::FsdpHandle handle = root;
    handle.unshard();
  }
  trace.params["fc1.weight"] = model->fc1->weight.detach().clone();
  trace.params["fc1.bias"] = model->fc1->bias.detach().clone();
  trace.params["fc2.weight"] = model->fc2->weight.detach().clone();
  trace.params["fc2.bias"] = model->fc2->bias.detach().clone();
  trace.params["fc3.weight"] = model->fc3->weight.detach().clone();
  trace.params["fc3.bias"] = model->fc3->bias.detach().clone();
  return trace;
}

void expect_matches_reference(const Trace& sharded) {
  static const Trace reference = train_reference();
  ASSERT_EQ(sharded.losses.size(), reference.losses.size());
  for (std::size_t step = 0; step < reference.losses.size(); ++step) {
    EXPECT_NEAR(sharded.losses[step], reference.losses[step],
                1e-6 * std::abs(reference.losses[step]))
        << "loss at step " << step;
  }
  for (const auto& [name, expected] : reference.params) {
    ASSERT_TRUE(sharded.params.contains(name)) << name;
    EXPECT_EQ(sharded.params.at(name).sizes(), expected.sizes()) << name;
    EXPECT_LT(rel_diff(sharded.params.at(name), expected), 1e-5) << name;
  }
}

TEST(FullyShard, LayersAndRootMatchSingleProcessTraining) {
  expect_matches_reference(train_sharded(Wrap::kLayersAndRoot, true, true));
}

TEST(FullyShard, KeepingFullParametersAfterForwardMatchesToo) {
  expect_matches_reference(train_sharded(Wrap::kLayersAndRoot, false, true));
}

// The statistics a per-phase profile is built from: every collective of a step counted with
// its full buffer's bytes, none on one rank, and none after a reset.
TEST(FullyShard, CommunicationCountsEveryCollectiveOfAStep) {
  Mlp model = seeded_model();
  const auto fc1 = mdist::fully_shard(*model->fc1);
  const auto fc2 = mdist::fully_shard(*model->fc2);
  const auto root = mdist::fully_shard(*model);
  const Data d = local_batch(0);
  torch::mse_loss(model->forward(d.x), d.y).backward();
  const int world = mdist::size();
  for (const auto* layer : {&fc1, &fc2}) {
    int64_t shard_numel = 0;
    const auto names = layer->managed_parameter_names();
    for (const auto& name : names) {
      int64_t numel = 1;
      for (const int64_t n : layer->shard_shape(name)) numel *= n;
      shard_numel += numel;
    }
    const mdist::FsdpCommStats stats = layer->communication();
    const int64_t expected = world > 1 ? 1 : 0;
    // Gathered before its forward and again before its backward (resharded in between).
    EXPECT_EQ(stats.all_gathers, 2 * expected);
    EXPECT_EQ(stats.all_gather_bytes, 2 * expected * world * shard_numel * 4);
    EXPECT_EQ(stats.reduce_scatters, expected);
    // Each rank's chunk: one has-gradient flag per parameter, then its shards.
    EXPECT_EQ(stats.reduce_scatter_bytes,
              expected * world * (static_cast<int64_t>(names.size()) + shard_numel) * 4);
    EXPECT_EQ(stats.all_reduces, 0);
    EXPECT_GE(stats.wait_s, 0.0);
    if (world == 1) {
      EXPECT_EQ(stats.wait_s, 0.0);
    }
  }
  mdist::FsdpHandle handle = fc1;
  handle.reset_communication();
  EXPECT_EQ(fc1.communication().all_gathers, 0);
  EXPECT_EQ(fc1.communication().wait_s, 0.0);
  EXPECT_EQ(fc2.communication().all_gathers, world > 1 ? 2 : 0);
  static_cast<void>(root);
}

// On one rank the shard is the whole parameter: forward computes on the shard's memory (no
// gather copy, no second copy of the weights), and resharding must not free the shard.
TEST(FullyShard, OneRankComputesOnTheShardsOwnMemory) {
  Mlp model = seeded_model();
  mdist::fully_shard(*model->fc1);
  const auto root = mdist::fully_shard(*model);
  const at::Tensor shard = model->fc1->named_parameters(false)["weight"];
  const at::Tensor before = shard.detach().clone();
  std::vector<bool> shares;
  auto probe = mdist::nn::register_forward_pre_hook(*model->fc1, [&](torch::nn::Module&, auto&) {
    shares.push_back(model->fc1->weight.data_ptr() == shard.data_ptr());
  });
  const Data d = local_batch(0);
  torch::mse_loss(model->forward(d.x), d.y).backward();
  probe.remove();
  ASSERT_EQ(shares.size(), 1u);
  EXPECT_EQ(shares[0], mdist::size() == 1);
  EXPECT_EQ(model->fc1->weight.storage().nbytes(), 0u);  // resharded: the alias is gone
  EXPECT_TRUE(torch::equal(shard.detach(), before));     // ... and the shard intact
  ASSERT_TRUE(shard.grad().defined());
  EXPECT_EQ(shard.grad().sizes(), shard.sizes());
  static_cast<void>(root);
}

TEST(FullyShard, RootOnlyMatches) {
  expect_matches_reference(train_sharded(Wrap::kRootOnly, true, false));
}

TEST(FullyShard, ShardsHoldCeilRowsAndParametersYieldsThem) {
  Mlp model = seeded_model();
  const auto handle = mdist::fully_shard(*model);
  const int world = mdist::size();
  const auto ceil_div = [&](int64_t rows) { return (rows + world - 1) / world; };
  EXPECT_EQ(handle.full_shape("fc2.weight"), (std::vector<int64_t>{12, 16}));
  EXPECT_EQ(handle.shard_shape("fc2.weight"), (std::vector<int64_t>{ceil_div(12), 16}));
  EXPECT_EQ(handle.shard_shape("fc3.bias"), (std::vector<int64_t>{ceil_div(5)}));
  for (const auto& p : model->named_parameters()) {
    EXPECT_EQ(p.value().size(0), ceil_div(handle.full_shape(p.key())[0])) << p.key();
    EXPECT_TRUE(p.value().is_leaf());
  }
  EXPECT_EQ(handle.managed_parameter_names().size(), 6u);
}

TEST(FullyShard, PrefetchGathersTheNextUnitBeforeItRuns) {
  Mlp model = seeded_model();
  const auto fc1 = mdist::fully_shard(*model->fc1);
  const auto fc2 = mdist::fully_shard(*model->fc2);
  const auto root = mdist::fully_shard(*model);
  // Registered after fully_shard's own hook: sees the state once fc1 has been gathered.
  std::vector<bool> fc2_ready;
  auto probe = mdist::nn::register_forward_pre_hook(*model->fc1, [&](torch::nn::Module&, auto&) {
    fc2_ready.push_back(fc2.is_gathering() || fc2.is_unsharded());
  });
  const Data d = local_batch(0);
  for (int step = 0; step < 2; ++step) {
    torch::mse_loss(model->forward(d.x), d.y).backward();
  }
  probe.remove();
  // The first pass records the order; from the second on, fc2's gather is already issued
  // while fc1 runs.
  ASSERT_EQ(fc2_ready.size(), 2u);
  EXPECT_TRUE(fc2_ready[1]);
  for (const auto* handle : {&fc1, &fc2, &root}) {
    EXPECT_FALSE(handle->is_unsharded());
    EXPECT_FALSE(handle->is_gathering());
  }
}

TEST(FullyShard, ForwardOnlyLeavesNothingGathered) {
  Mlp model = seeded_model();
  Mlp reference = seeded_model();
  const auto layer = mdist::fully_shard(*model->fc1);
  const auto root = mdist::fully_shard(*model);
  const at::NoGradGuard no_grad;
  const at::Tensor x = global_batch(0).x;
  EXPECT_LT(rel_diff(model->forward(x), reference->forward(x)), 1e-6);
  EXPECT_FALSE(layer.is_unsharded());
  EXPECT_FALSE(root.is_unsharded());
  EXPECT_EQ(model->fc1->weight.storage().nbytes(), 0u);
}

TEST(FullyShard, GradientAccumulationWithoutSync) {
  // Two micro-batches, no communication on the first: the same step as one global batch.
  Mlp model = seeded_model();
  Mlp reference = seeded_model();
  auto root = mdist::fully_shard(*model);
  const Data d = local_batch(0);
  const int64_t n = d.x.size(0);
  const int64_t a = n / 2;  // two micro-batches of a and n - a samples
  if (a == 0) GTEST_SKIP() << "needs two samples per rank";
  const double wa = static_cast<double>(a) / n;
  root.set_requires_gradient_sync(false);
  root.set_reshard_after_backward(false);
  (torch::mse_loss(model->forward(d.x.narrow(0, 0, a)), d.y.narrow(0, 0, a)) * wa).backward();
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
  EXPECT_TRUE(root.is_unsharded());  // kept for the next micro-batch
  root.set_requires_gradient_sync(true);
  root.set_reshard_after_backward(true);
  (torch::mse_loss(model->forward(d.x.narrow(0, a, n - a)), d.y.narrow(0, a, n - a)) * (1 - wa))
      .backward();

  EXPECT_FALSE(root.is_unsharded());
  const Data g = global_batch(0);
  torch::mse_loss(reference->forward(g.x), g.y).backward();
  for (const auto& p : model->named_parameters()) {
    const at::Tensor full_grad = reference->named_parameters()[p.key()].grad();
    const int64_t rows = full_grad.dim() > 0 ? full_grad.size(0) : 1;
    const int64_t chunk = p.value().size(0);
    const int64_t first = mdist::rank() * chunk;
    const int64_t own = std::max<int64_t>(0, std::min(chunk, rows - first));
    if (own == 0) continue;
    EXPECT_LT(rel_diff(p.value().grad().narrow(0, 0, own), full_grad.narrow(0, first, own)), 1e-5)
        << p.key();
  }
}

TEST(FullyShard, IgnoredParametersStayWhole) {
  Mlp model = seeded_model();
  Mlp reference = seeded_model();
  mdist::FullyShardOptions options;
  options.ignored_params = {model->fc3->weight, model->fc3->bias};
  const auto root = mdist::fully_shard(*model, options);
  EXPECT_EQ(root.managed_parameter_names().size(), 4u);
  EXPECT_EQ(model->fc3->weight.sizes(), (c10::IntArrayRef{5, 12}));
  const at::Tensor x = global_batch(0).x;
  const at::NoGradGuard no_grad;
  EXPECT_LT(rel_diff(model->forward(x), reference->forward(x)), 1e-6);
}

// A destroyed wrapped model frees its shards and gathered full parameters at once, even while
// handles to its units live on: units hold the model's tensors weakly.
TEST(FullyShard, ADestroyedModelFreesItsMemoryAtOnce) {
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages;
  std::vector<mdist::FsdpHandle> units;
  {
    Mlp model = seeded_model();
    mdist::FullyShardOptions options;
    options.reshard_after_forward = false;  // the full parameters stay gathered
    units.push_back(mdist::fully_shard(*model->fc1, options));
    units.push_back(mdist::fully_shard(*model, options));
    model->forward(global_batch(0).x);
    ASSERT_TRUE(units.front().is_unsharded());
    for (const auto& p : model->parameters()) {
      storages.push_back(p.storage().getWeakStorageImpl());  // shards
    }
    storages.push_back(model->fc1->weight.storage().getWeakStorageImpl());  // full
    ASSERT_GT(model->fc1->weight.storage().nbytes(), 0u);
  }
  for (std::size_t i = 0; i < storages.size(); ++i) {
    EXPECT_TRUE(storages[i].expired()) << "storage " << i << " outlived its model";
  }
  EXPECT_FALSE(units.front().is_unsharded());
}

using mdist::testing::error_of;

// gradient_divide_factor f: the summed gradient divided by f instead of the group's size. With
// plain SGD that is the averaged run at lr * world / f, step for step; with a group of one rank
// too (where nothing is communicated but the division still applies), and with the replicated
// (ignored) parameters, which are all-reduced rather than reduce-scattered.
TEST(FullyShard, GradientDivideFactorScalesTheAveragedGradient) {
  const double lr = 0.1, factor = 2.5 * mdist::size();
  Mlp reference = seeded_model();
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(lr / 2.5));
  Mlp model = seeded_model();
  mdist::FullyShardOptions options;
  options.gradient_divide_factor = factor;
  options.ignored_params = {model->fc3->bias};
  mdist::fully_shard(*model->fc1, options);
  const mdist::FsdpHandle root = mdist::fully_shard(*model, options);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(lr));
  for (int step = 0; step < 3; ++step) {
    const Data all = global_batch(step), mine = local_batch(step);
    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(all.x), all.y).backward();
    ref_opt.step();
    opt.zero_grad();
    torch::mse_loss(model->forward(mine.x), mine.y).backward();
    opt.step();
  }
  mdist::FsdpHandle(root).unshard();
  mdist::fsdp_handle(*model->fc1)->unshard();
  // The modules' own tensors hold the gathered parameters (parameters() yields the shards).
  const std::map<std::string, at::Tensor> full = {
      {"fc1.weight", model->fc1->weight}, {"fc1.bias", model->fc1->bias},
      {"fc2.weight", model->fc2->weight}, {"fc2.bias", model->fc2->bias},
      {"fc3.weight", model->fc3->weight}, {"fc3.bias", model->fc3->bias}};
  for (const auto& p : reference->named_parameters()) {
    EXPECT_LT(rel_diff(full.at(p.key()), p.value()), 1e-5) << p.key();
  }
  EXPECT_THAT(error_of([] {
                Mlp other = seeded_model();
                mdist::FullyShardOptions bad;
                bad.gradient_divide_factor = 0.0;
                mdist::fully_shard(*other, bad);
              }),
              HasSubstr("gradient_divide_factor must be positive and finite, got 0"));
}

TEST(FullyShard, BadInput) {
  Mlp model = seeded_model();
  mdist::fully_shard(*model->fc1);
  EXPECT_THAT(
      error_of([&] { mdist::fully_shard(*model->fc1); }),
      HasSubstr("fully_shard: torch::nn::LinearImpl is already wrapped; wrap each module once"));
  torch::nn::ReLU relu;
  EXPECT_THAT(error_of([&] { mdist::fully_shard(*relu); }),
              HasSubstr("has no parameters to manage"));
  torch::nn::Linear zero_rows(4, 0);
  EXPECT_THAT(error_of([&] { mdist::fully_shard(*zero_rows); }),
              HasSubstr("parameter 'weight' has 0 rows along dim 0"));
  Mlp mixed = seeded_model();
  mixed->fc2->to(torch::kDouble);
  EXPECT_THAT(error_of([&] { mdist::fully_shard(*mixed); }),
              HasSubstr("parameters of one unit must share a dtype, but 'fc1.weight' is Float and "
                        "'fc2.weight' is Double"));
  // A group this rank is not in has size and rank -1 (torch's convention): nothing to shard.
  const mdist::Group first = mdist::new_group({0});
  if (!first.is_member()) {
    Mlp outside = seeded_model();
    mdist::FullyShardOptions options;
    options.group = first;
    EXPECT_THAT(error_of([&] { mdist::fully_shard(*outside, options); }),
                HasSubstr(": this rank is not a member of " + first.name()));
  }
}

}  // namespace

#include "tests/fsdp/tiny_transformer.h"

namespace {

using mdist::testing::TinyTransformer;

// Next-token loss on a fixed random token stream; the global batch is 12 sequences of 6.
at::Tensor tokens(int step) {
  torch::manual_seed(3000 + step);
  return torch::randint(0, TinyTransformer::Impl::kVocab, {kGlobalBatch, 7});
}

at::Tensor lm_loss(TinyTransformer& model, const at::Tensor& batch) {
  const at::Tensor logits = model->forward(batch.narrow(1, 0, 6));
  return torch::cross_entropy_loss(logits.reshape({-1, TinyTransformer::Impl::kVocab}),
                                   batch.narrow(1, 1, 6).reshape({-1}));
}

TinyTransformer seeded_transformer() {
  torch::manual_seed(5);
  return TinyTransformer();
}

std::vector<double> train_transformer(TinyTransformer& model, bool sharded,
                                      std::map<std::string, at::Tensor>* params) {
  torch::optim::AdamW opt(model->parameters(), adamw());
  std::vector<double> losses;
  const int per_rank = kGlobalBatch / mdist::size();
  for (int step = 0; step < kSteps; ++step) {
    const at::Tensor all = tokens(step);
    const at::Tensor batch = sharded ? all.narrow(0, mdist::rank() * per_rank, per_rank) : all;
    opt.zero_grad();
    const at::Tensor loss = lm_loss(model, batch);
    loss.backward();
    opt.step();
    losses.push_back(sharded ? mdist::allreduce(loss.item<double>()) / mdist::size()
                             : loss.item<double>());
  }
  if (!sharded) {
    for (const auto& p : model->named_parameters()) (*params)[p.key()] = p.value().detach().clone();
  }
  return losses;
}

class TransformerStack : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(TransformerStack, MatchesSingleProcessTraining) {
  const auto [wrap_layers, reshard_after_forward] = GetParam();
  TinyTransformer reference = seeded_transformer();
  std::map<std::string, at::Tensor> expected;
  const auto expected_losses = train_transformer(reference, false, &expected);

  TinyTransformer model = seeded_transformer();
  mdist::FullyShardOptions options;
  options.reshard_after_forward = reshard_after_forward;
  std::vector<mdist::FsdpHandle> units;
  if (wrap_layers) {
    for (const auto& layer : *model->layers) units.push_back(mdist::fully_shard(*layer, options));
  }
  units.push_back(mdist::fully_shard(*model, options));
  const auto losses = train_transformer(model, true, nullptr);
  for (std::size_t step = 0; step < losses.size(); ++step) {
    EXPECT_NEAR(losses[step], expected_losses[step], 1e-6 * expected_losses[step]) << step;
  }
  for (auto& unit : units) {
    EXPECT_FALSE(unit.is_unsharded());
    unit.unshard();
  }
  for (const auto& [name, value] : expected) {
    // Full parameters are the modules' own tensors; find them by walking the model.
    const at::Tensor* found = nullptr;
    for (const auto& m : model->named_modules()) {
      const auto prefix = m.key().empty() ? std::string() : m.key() + ".";
      if (name.rfind(prefix, 0) != 0) continue;
      const auto local = name.substr(prefix.size());
      if (local.find('.') != std::string::npos) continue;
      if (auto* linear = m.value()->as<torch::nn::Linear>()) {
        found = local == "weight" ? &linear->weight : &linear->bias;
      } else if (auto* norm = m.value()->as<torch::nn::LayerNorm>()) {
        found = local == "weight" ? &norm->weight : &norm->bias;
      } else if (auto* embed = m.value()->as<torch::nn::Embedding>()) {
        found = &embed->weight;
      }
    }
    ASSERT_NE(found, nullptr) << name;
    EXPECT_LT(rel_diff(*found, value), 1e-5) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Wrapping, TransformerStack,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& param_info) {
                           return std::string(std::get<0>(param_info.param) ? "LayersAndRoot"
                                                                            : "RootOnly") +
                                  (std::get<1>(param_info.param) ? "Reshard" : "KeepFull");
                         });

}  // namespace
