// Expert-parallel dispatch and combine against every expert computed locally (run by mdistrun
// with 1, 2, 3 and 4 ranks; the expert-parallel group is the world, and on 4 ranks also pairs).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <vector>

#include "mdist/ep/dispatch.h"
#include "mdist/mdist.h"
#include "tests/support/error_of.h"

namespace {

using ::testing::HasSubstr;

constexpr int64_t kHidden = 6;
constexpr int64_t kTopK = 2;

// Expert e: x -> tanh(x W_e) with W_e [hidden, hidden], the same seeded values on every rank.
std::vector<at::Tensor> make_experts(int64_t num_experts) {
  torch::manual_seed(11);
  std::vector<at::Tensor> weights;
  for (int64_t e = 0; e < num_experts; ++e) {
    weights.push_back(torch::randn({kHidden, kHidden}).requires_grad_());
  }
  return weights;
}

at::Tensor run_expert(const at::Tensor& w, const at::Tensor& x) { return torch::tanh(x.matmul(w)); }

// A gradient, or zeros where autograd produced none (a tensor that fed nothing, e.g. with no
// tokens).
at::Tensor grad_or_zeros(const at::Tensor& t) {
  return t.grad().defined() ? t.grad().clone() : torch::zeros_like(t);
}

struct Routed {
  at::Tensor hidden, index, weight;
};

// This rank's tokens and routing. `skew` sends every token to experts of the first rank only
// (so other ranks receive nothing), exercising empty exchanges.
Routed routed_tokens(int64_t tokens, int64_t num_experts, bool skew) {
  torch::manual_seed(100 + mdist::rank());
  Routed r;
  r.hidden = torch::randn({tokens, kHidden}).requires_grad_();
  const int64_t range =
      skew ? std::max<int64_t>(num_experts / std::max(mdist::size(), 1), 1) : num_experts;
  // Distinct experts per token, as top-k gives.
  at::Tensor first = torch::randint(range, {tokens, 1}, torch::kLong);
  at::Tensor second =
      (first + 1 + torch::randint(std::max<int64_t>(range - 1, 1), {tokens, 1}, torch::kLong)) %
      std::max<int64_t>(range, 2);
  if (range == 1) second = (first + 1) % num_experts;
  r.index = torch::cat({first, second}, 1);
  r.weight = torch::softmax(torch::randn({tokens, kTopK}), 1).requires_grad_();
  return r;
}

// Every expert local: the reference.
at::Tensor local_reference(const Routed& r, const std::vector<at::Tensor>& experts) {
  // Starts from the hidden states (times 0) so that even zero tokens give a graph.
  at::Tensor out = r.hidden * 0;
  for (int64_t t = 0; t < r.hidden.size(0); ++t) {
    for (int64_t k = 0; k < kTopK; ++k) {
      const int64_t e = r.index[t][k].item<int64_t>();
      out[t] += r.weight[t][k] * run_expert(experts[e], r.hidden[t].unsqueeze(0)).squeeze(0);
    }
  }
  return out;
}

void check_against_reference(int64_t num_experts, int64_t tokens, bool skew,
                             const mdist::Group& group) {
  const mdist::ep::ExpertRange mine = mdist::ep::owned_experts(num_experts, group);
  const std::vector<at::Tensor> experts = make_experts(num_experts);
  const Routed r = routed_tokens(tokens, num_experts, skew);

  at::Tensor out = mdist::ep::dispatch_combine(
      r.hidden, r.index, r.weight, num_experts, group, [&](int64_t local, const at::Tensor& rows) {
        EXPECT_LT(local, mine.count);
        return run_expert(experts[mine.first + local], rows);
      });
  const at::Tensor upstream = torch::randn_like(out);  // a fixed, rank-dependent loss weight
  (out * upstream).sum().backward();
  const at::Tensor grad_hidden = grad_or_zeros(r.hidden);
  const at::Tensor grad_weight = grad_or_zeros(r.weight);
  std::vector<at::Tensor> grad_experts;
  for (const auto& w : experts) {
    grad_experts.push_back(grad_or_zeros(w));
  }

  // Reference: same tokens, all experts here; the expert gradients then summed over the group
  // (with EP each owner gets every rank's contribution).
  const std::vector<at::Tensor> ref_experts = make_experts(num_experts);
  Routed ref = r;
  ref.hidden = r.hidden.detach().clone().requires_grad_();
  ref.weight = r.weight.detach().clone().requires_grad_();
  const at::Tensor ref_out = local_reference(ref, ref_experts);
  (ref_out * upstream).sum().backward();

  EXPECT_TRUE(torch::allclose(out, ref_out, 1e-5, 1e-6)) << (out - ref_out).abs().max();
  EXPECT_TRUE(torch::allclose(grad_hidden, grad_or_zeros(ref.hidden), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(grad_weight, grad_or_zeros(ref.weight), 1e-5, 1e-6));
  for (int64_t e = 0; e < num_experts; ++e) {
    const at::Tensor reference = grad_or_zeros(ref_experts[e]);
    const std::vector<double> flat(reference.data_ptr<float>(),
                                   reference.data_ptr<float>() + reference.numel());
    std::vector<double> summed = flat;
    if (mdist::size(group) > 1) {
      const auto all = mdist::allgather(flat, group);
      std::fill(summed.begin(), summed.end(), 0.0);
      for (const auto& one : all) {
        for (std::size_t i = 0; i < one.size(); ++i) summed[i] += one[i];
      }
    }
    const bool owned = e >= mine.first && e < mine.first + mine.count;
    const at::Tensor want =
        owned ? torch::tensor(summed).reshape(reference.sizes()).to(torch::kFloat32)
              : torch::zeros_like(reference);
    EXPECT_TRUE(torch::allclose(grad_experts[e], want, 1e-4, 1e-5))
        << "expert " << e << (owned ? " (owned)" : " (not owned: must get no gradient)");
  }
}

TEST(ExpertDispatch, MatchesLocalExpertsOverTheWorld) {
  const int64_t experts = 2 * mdist::size();
  check_against_reference(experts, 7 + mdist::rank(), /*skew=*/false, mdist::Group::world());
}

TEST(ExpertDispatch, RanksThatReceiveNoTokensStillTakePart) {
  const int64_t experts = 2 * mdist::size();
  check_against_reference(experts, 5, /*skew=*/true, mdist::Group::world());
}

TEST(ExpertDispatch, ARankWithoutTokens) {
  const int64_t experts = mdist::size();
  check_against_reference(experts, mdist::rank() == 0 ? 0 : 3, /*skew=*/false,
                          mdist::Group::world());
}

TEST(ExpertDispatch, ExpertParallelGroupsFromParallelState) {
  if (mdist::size() != 4) GTEST_SKIP() << "needs 4 ranks (ep = 2 inside dp = 4)";
  const mdist::ParallelState state = mdist::make_parallel_state({.expert_model_parallel = 2});
  const mdist::Group group = state.expert_model_parallel_group.group();
  ASSERT_EQ(mdist::size(group), 2);
  check_against_reference(4, 6, /*skew=*/false, group);
}

TEST(ExpertDispatch, AllToAllWithUnevenSplitsAndItsBackward) {
  const int world = mdist::size(), me = mdist::rank();
  // Rank s sends (s + d) % 3 rows to rank d, each row [s, d, i].
  std::vector<int64_t> send, recv;
  std::vector<at::Tensor> rows;
  for (int d = 0; d < world; ++d) {
    send.push_back((me + d) % 3);
    recv.push_back((d + me) % 3);
    for (int64_t i = 0; i < send.back(); ++i) {
      rows.push_back(
          torch::tensor({static_cast<float>(me), static_cast<float>(d), static_cast<float>(i)}));
    }
  }
  at::Tensor input = (rows.empty() ? torch::zeros({0, 3}) : torch::stack(rows)).requires_grad_();
  const at::Tensor output = mdist::ep::all_to_all(input, send, recv, mdist::Group::world());
  int64_t row = 0;
  for (int s = 0; s < world; ++s) {
    for (int64_t i = 0; i < recv[s]; ++i, ++row) {
      EXPECT_EQ(output[row][0].item<float>(), s);
      EXPECT_EQ(output[row][1].item<float>(), me);
      EXPECT_EQ(output[row][2].item<float>(), i);
    }
  }
  EXPECT_EQ(row, output.size(0));
  // d(sum(output * output))/d input = 2 * input: each row's gradient came back home.
  (output * output).sum().backward();
  EXPECT_TRUE(torch::equal(input.grad(), 2 * input.detach()));
}

TEST(ExpertDispatch, BadInput) {
  const int world = mdist::size();
  if (world > 1) {
    EXPECT_THAT(mdist::testing::error_of(
                    [&] { (void)mdist::ep::owned_experts(world + 1, mdist::Group::world()); }),
                HasSubstr("do not divide over an expert-parallel group of " +
                          std::to_string(world) + " ranks"));
  }
  const at::Tensor hidden = torch::zeros({2, kHidden});
  const at::Tensor weight = torch::ones({2, kTopK});
  EXPECT_THAT(mdist::testing::error_of([&] {
                (void)mdist::ep::dispatch_combine(
                    hidden, torch::full({2, kTopK}, world, torch::kLong), weight, world,
                    mdist::Group::world(), [](int64_t, const at::Tensor& x) { return x; });
              }),
              HasSubstr("an expert index outside [0, " + std::to_string(world) + ")"));
  EXPECT_THAT(mdist::testing::error_of([&] {
                (void)mdist::ep::dispatch_combine(hidden, torch::zeros({3, kTopK}, torch::kLong),
                                                  weight, world, mdist::Group::world(),
                                                  [](int64_t, const at::Tensor& x) { return x; });
              }),
              HasSubstr("expected hidden [tokens, hidden]"));
}

}  // namespace
