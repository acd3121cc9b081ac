// fully_shard's state dicts, clip_grad_norm_ and mixed precision, against single-process
// references (run by mdistrun with 1, 2, 3 and 4 ranks).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/fsdp/state_dict.h"
#include "mdist/mdist.h"
#include "tests/fsdp/mlp.h"

namespace {

using mdist::testing::Mlp;
using ::testing::HasSubstr;

constexpr int kGlobalBatch = 12;

struct Data {
  at::Tensor x, y;
};

Data global_batch(int step) {
  torch::manual_seed(2000 + step);
  return {torch::randn({kGlobalBatch, 8}), torch::randn({kGlobalBatch, 5})};
}

Data local_batch(int step, int rank, int world) {
  const Data all = global_batch(step);
  const int per_rank = kGlobalBatch / world;
  return {all.x.narrow(0, rank * per_rank, per_rank), all.y.narrow(0, rank * per_rank, per_rank)};
}

Mlp seeded_model() {
  torch::manual_seed(11);
  return Mlp();
}

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kDouble) - b.to(at::kDouble)).abs().max() /
          b.to(at::kDouble).abs().max().clamp_min(1e-12))
      .item<double>();
}

void wrap(Mlp& model, const mdist::FullyShardOptions& options = {}) {
  // The layers hand their outputs to the next layer in the compute dtype; only the root
  // casts what leaves the model.
  mdist::FullyShardOptions layer_options = options;
  layer_options.mp_policy.output_dtype.reset();
  mdist::fully_shard(*model->fc1, layer_options);
  mdist::fully_shard(*model->fc2, layer_options);
  mdist::fully_shard(*model, options);
}

std::map<std::string, at::Tensor> reference_params(Mlp& model) {
  std::map<std::string, at::Tensor> params;
  for (const auto& p : model->named_parameters()) params[p.key()] = p.value().detach().clone();
  return params;
}

void expect_same(const std::map<std::string, at::Tensor>& got,
                 const std::map<std::string, at::Tensor>& expected, double tolerance) {
  ASSERT_EQ(got.size(), expected.size());
  for (const auto& [name, value] : expected) {
    ASSERT_TRUE(got.contains(name)) << name;
    EXPECT_EQ(got.at(name).sizes(), value.sizes()) << name;
    EXPECT_LE(rel_diff(got.at(name), value), tolerance) << name;
  }
}

TEST(ClipGradNorm, MatchesTheReferenceEveryStep) {
  Mlp reference = seeded_model();
  Mlp model = seeded_model();
  wrap(model);
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 5; ++step) {
    const Data g = global_batch(step);
    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(g.x), g.y).backward();
    const double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.05);
    ref_opt.step();

    const Data d = local_batch(step, mdist::rank(), mdist::size());
    opt.zero_grad();
    torch::mse_loss(model->forward(d.x), d.y).backward();
    const double norm = mdist::clip_grad_norm_(*model, 0.05);
    opt.step();
    EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm) << "step " << step;
  }
  expect_same(mdist::full_state_dict(*model, {.rank0_only = false, .cpu = true}),
              reference_params(reference), 1e-5);
  EXPECT_THAT(
      [&] {
        try {
          mdist::clip_grad_norm_(*model, 1.0, 1.0);
        } catch (const mdist::Error& e) {
          return std::string(e.what());
        }
        return std::string();
      }(),
      HasSubstr("norm_type must be 2 or infinity"));
}

TEST(StateDict, FullRoundTripMatchesTheReference) {
  Mlp reference = seeded_model();
  Mlp model = seeded_model();
  wrap(model);
  const auto full = mdist::full_state_dict(*model);
  if (mdist::is_master()) {
    expect_same(full, reference_params(reference), 0.0);
  } else {
    EXPECT_TRUE(full.empty());  // rank0_only
  }
  // Load the reference's weights after changing them, into a fresh sharded model.
  {
    const at::NoGradGuard no_grad;
    for (auto& p : reference->parameters()) p.mul_(-0.5);
  }
  Mlp loaded = seeded_model();
  wrap(loaded);
  mdist::load_full_state_dict(*loaded, reference_params(reference));
  expect_same(mdist::full_state_dict(*loaded, {.rank0_only = false, .cpu = true}),
              reference_params(reference), 0.0);
  const at::NoGradGuard no_grad;
  const at::Tensor x = global_batch(0).x;
  EXPECT_LT(rel_diff(loaded->forward(x), reference->forward(x)), 1e-6);
}

// `only`: each rank keeps just the keys it asks for (here a different one per rank), gathered
// whole, while every unit is still gathered collectively.
TEST(StateDict, FullStateDictKeepsOnlyTheAcceptedKeys) {
  Mlp reference = seeded_model();
  Mlp model = seeded_model();
  wrap(model);
  const std::string wanted = mdist::rank() % 2 == 0 ? "fc2.weight" : "fc3.bias";
  const auto kept = mdist::full_state_dict(
      *model, {.keep = true, .only = [&](const std::string& name) { return name == wanted; }});
  ASSERT_EQ(kept.size(), 1u);
  ASSERT_TRUE(kept.contains(wanted));
  EXPECT_TRUE(torch::equal(kept.at(wanted), reference_params(reference).at(wanted)));
  // A rank that keeps nothing gets nothing, whatever `only` says.
  EXPECT_TRUE(mdist::full_state_dict(
                  *model, {.keep = false, .only = [](const std::string&) { return true; }})
                  .empty());
}

TEST(StateDict, ShardedRoundTrip) {
  Mlp model = seeded_model();
  wrap(model);
  const auto sharded = mdist::sharded_state_dict(*model);
  const auto& fc2 = sharded.at("fc2.weight");
  EXPECT_EQ(fc2.full_shape, (std::vector<int64_t>{12, 16}));
  const int64_t chunk = (12 + mdist::size() - 1) / mdist::size();
  EXPECT_EQ(fc2.row_offset, mdist::rank() * chunk);
  Mlp other = Mlp();  // different initialisation
  wrap(other);
  mdist::load_sharded_state_dict(*other, sharded);
  expect_same(mdist::full_state_dict(*other, {.rank0_only = false, .cpu = true}),
              mdist::full_state_dict(*model, {.rank0_only = false, .cpu = true}), 0.0);
}

TEST(StateDict, BadDictsAreNamed) {
  Mlp model = seeded_model();
  wrap(model);
  auto full = mdist::full_state_dict(*model, {.rank0_only = false, .cpu = true});
  const auto error_of = [&](const std::map<std::string, at::Tensor>& state) {
    try {
      mdist::load_full_state_dict(*model, state);
    } catch (const mdist::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto missing = full;
  missing.erase("fc3.bias");
  EXPECT_THAT(error_of(missing), HasSubstr("load_full_state_dict: missing key 'fc3.bias'"));
  auto extra = full;
  extra["fc4.weight"] = at::zeros({1});
  EXPECT_THAT(error_of(extra), HasSubstr("unexpected key 'fc4.weight'"));
  auto wrong = full;
  wrong["fc2.weight"] = at::zeros({3, 3});
  EXPECT_THAT(error_of(wrong),
              HasSubstr("'fc2.weight' has shape [3, 3] but the model's is [12, 16]"));
}

TEST(StateDict, SavedFromTwoRanksLoadsIntoTheWholeWorld) {
  const int world = mdist::size();
  if (world < 3) GTEST_SKIP() << "needs 3 or more ranks";
  // Train on a group of 2 ranks, gather there, hand the dict to every rank, load into a model
  // sharded over the whole world.
  const mdist::Group pair = mdist::new_group({0, 1});
  std::map<std::string, at::Tensor> saved;
  if (pair.is_member()) {
    Mlp model = seeded_model();
    mdist::FullyShardOptions options;
    options.group = pair;
    wrap(model, options);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    const Data d = local_batch(0, mdist::rank(pair), 2);
    torch::mse_loss(model->forward(d.x), d.y).backward();
    opt.step();
    saved = mdist::full_state_dict(*model);
  }
  saved = mdist::broadcast(saved, 0);
  ASSERT_EQ(saved.size(), 6u);
  Mlp everywhere = Mlp();
  wrap(everywhere);
  mdist::load_full_state_dict(*everywhere, saved);
  expect_same(mdist::full_state_dict(*everywhere, {.rank0_only = false, .cpu = true}), saved, 0.0);
}

TEST(CpuOffload, ShardsAndGradientsStayOnTheCpuAndTrainingMatches) {
  Mlp reference = seeded_model();
  Mlp model = seeded_model();
  mdist::FullyShardOptions options;
  options.offload_policy = mdist::CPUOffloadPolicy{};
  wrap(model, options);
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 5; ++step) {
    const Data g = global_batch(step);
    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(g.x), g.y).backward();
    ref_opt.step();
    const Data d = local_batch(step, mdist::rank(), mdist::size());
    opt.zero_grad();
    torch::mse_loss(model->forward(d.x), d.y).backward();
    for (const auto& p : model->parameters()) {
      EXPECT_TRUE(p.is_cpu());
      EXPECT_TRUE(p.grad().is_cpu());
    }
    opt.step();
  }
  expect_same(mdist::full_state_dict(*model, {.rank0_only = false, .cpu = true}),
              reference_params(reference), 1e-5);
}

// bf16 compute with fp32 shards and fp32 gradient reduction, against a reference that runs
// the same precision recipe in one process: fp32 master weights, a bf16 copy for forward and
// backward, fp32 gradients into AdamW. The two differ only in how bf16 gradients are summed
// (per rank, then across ranks in fp32, versus one bf16 matmul over the global batch), an
// error of a few bf16 ulps (2^-8 relative) per gradient; AdamW's normalised updates keep that
// from growing over 5 steps, so losses agree to 2e-2 and weights to 2e-2 of their largest
// magnitude.
TEST(MixedPrecision, Bf16ComputeFp32Reduce) {
  Mlp master = seeded_model();
  Mlp compute = seeded_model();
  Mlp model = seeded_model();
  mdist::FullyShardOptions options;
  options.mp_policy.param_dtype = at::kBFloat16;
  options.mp_policy.reduce_dtype = at::kFloat;
  options.mp_policy.output_dtype = at::kFloat;
  wrap(model, options);
  compute->to(at::kBFloat16);
  torch::optim::AdamW ref_opt(master->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 5; ++step) {
    const Data g = global_batch(step);
    {
      const at::NoGradGuard no_grad;
      auto src = master->parameters();
      auto dst = compute->parameters();
      for (std::size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
    }
    compute->zero_grad();
    const at::Tensor ref_loss =
        torch::mse_loss(compute->forward(g.x.to(at::kBFloat16)).to(at::kFloat), g.y);
    ref_loss.backward();
    {
      auto src = compute->parameters();
      auto dst = master->parameters();
      for (std::size_t i = 0; i < src.size(); ++i)
        dst[i].mutable_grad() = src[i].grad().to(at::kFloat);
    }
    ref_opt.step();

    const Data d = local_batch(step, mdist::rank(), mdist::size());
    opt.zero_grad();
    const at::Tensor out = model->forward(d.x);
    EXPECT_EQ(out.scalar_type(), at::kFloat);
    const at::Tensor loss = torch::mse_loss(out, d.y);
    loss.backward();
    for (const auto& p : model->parameters()) {
      EXPECT_EQ(p.scalar_type(), at::kFloat);
      EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
    }
    opt.step();
    const double global_loss = mdist::allreduce(loss.item<double>()) / mdist::size();
    EXPECT_NEAR(global_loss, ref_loss.item<double>(), 2e-2 * ref_loss.item<double>()) << step;
  }
  expect_same(mdist::full_state_dict(*model, {.rank0_only = false, .cpu = true}),
              reference_params(master), 2e-2);
}

}  // namespace
