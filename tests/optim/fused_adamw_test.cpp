// mdist::optim::FusedAdamW against libtorch's own torch::optim::AdamW: the same updates (to
// rounding), the same state, options read at every step, parameters without gradients
// skipped.
#include "mdist/optim/fused_adamw.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "mdist/error.h"

namespace {

using torch::optim::AdamW;
using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;
using torch::optim::OptimizerParamGroup;

std::vector<at::Tensor> make_params(at::ScalarType dtype) {
  torch::manual_seed(7);
  std::vector<at::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{17, 5}, {33}, {}, {3, 4, 2}}) {
    params.push_back(torch::randn(shape, torch::dtype(dtype)).requires_grad_());
  }
  return params;
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_());
  return out;
}

// Two groups (matrices with decay and a higher lr, the rest without), as a training recipe
// builds them.
std::vector<OptimizerParamGroup> groups_of(const std::vector<at::Tensor>& p, bool amsgrad) {
  const auto base = AdamWOptions(1e-2).betas({0.9, 0.95}).eps(1e-8).amsgrad(amsgrad);
  std::vector<OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{p[0], p[3]},
                      std::make_unique<AdamWOptions>(AdamWOptions(base).weight_decay(0.1)));
  groups.emplace_back(std::vector<at::Tensor>{p[1], p[2]},
                      std::make_unique<AdamWOptions>(AdamWOptions(base).lr(3e-3).weight_decay(0)));
  return groups;
}

// Sets the same pseudo-random gradient on both sets; parameter 1 gets none on even steps
// (a frozen branch), so its state must advance only when it has one.
void set_gradients(int step, const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  torch::manual_seed(100 + step);
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (i == 1 && step % 2 == 0) {
      a[i].mutable_grad() = at::Tensor();
      b[i].mutable_grad() = at::Tensor();
      continue;
    }
    const at::Tensor g = torch::randn(a[i].sizes(), torch::dtype(torch::kFloat64)) * (1 + step);
    a[i].mutable_grad() = g.to(a[i].scalar_type());
    b[i].mutable_grad() = g.to(b[i].scalar_type());
  }
}

// Largest difference relative to the tensor's largest magnitude: elementwise ratios would
// blow up where a moment cancels to near zero.
double max_rel(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.to(torch::kFloat64), y = b.to(torch::kFloat64);
  return ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item<double>();
}

void expect_same_training(at::ScalarType dtype, bool amsgrad, double tolerance) {
  const auto reference_params = make_params(dtype);
  const auto fused_params = clones(reference_params);
  AdamW reference(groups_of(reference_params, amsgrad));
  mdist::optim::FusedAdamW fused(groups_of(fused_params, amsgrad));
  for (int step = 0; step < 25; ++step) {
    if (step == 12) {  // a schedule changing the lr between steps
      for (auto* opt : std::vector<torch::optim::Optimizer*>{&reference, &fused}) {
        static_cast<AdamWOptions&>(opt->param_groups()[0].options()).lr(5e-3);
      }
    }
    set_gradients(step, reference_params, fused_params);
    reference.step();
    fused.step();
  }
  for (std::size_t i = 0; i < reference_params.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_LE(max_rel(fused_params[i], reference_params[i]), tolerance);
    const auto& want = static_cast<const AdamWParamState&>(
        *reference.state().at(reference_params[i].unsafeGetTensorImpl()));
    const auto& got = static_cast<const AdamWParamState&>(
        *fused.state().at(fused_params[i].unsafeGetTensorImpl()));
    EXPECT_EQ(got.step(), want.step());
    EXPECT_EQ(got.step(), i == 1 ? 12 : 25);
    EXPECT_LE(max_rel(got.exp_avg(), want.exp_avg()), tolerance);
    EXPECT_LE(max_rel(got.exp_avg_sq(), want.exp_avg_sq()), tolerance);
    EXPECT_EQ(got.max_exp_avg_sq().defined(), amsgrad);
    if (amsgrad) {
      EXPECT_LE(max_rel(got.max_exp_avg_sq(), want.max_exp_avg_sq()), tolerance);
    }
  }
}

TEST(FusedAdamW, MatchesAdamWInFloat) { expect_same_training(torch::kFloat32, false, 1e-6); }
TEST(FusedAdamW, MatchesAdamWInDouble) { expect_same_training(torch::kFloat64, false, 1e-12); }
TEST(FusedAdamW, MatchesAdamWWithAmsgrad) { expect_same_training(torch::kFloat64, true, 1e-12); }

TEST(FusedAdamW, ChangesParametersAwayFromAZeroDecayNoOp) {
  // A mutation check on the kernel call itself: one step must move every parameter that has a
  // gradient by about lr (Adam's first step is lr * sign(grad)).
  auto params = make_params(torch::kFloat32);
  const auto before = clones(params);
  mdist::optim::FusedAdamW fused(params, AdamWOptions(1e-2).weight_decay(0));
  for (auto& p : params) p.mutable_grad() = torch::ones_like(p);
  fused.step();
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(params[i], before[i] - 1e-2, 1e-5, 1e-6));
  }
}

TEST(FusedAdamW, BFloat16ParametersFollowTheFloatUpdate) {
  const auto reference_params = make_params(torch::kFloat32);
  std::vector<at::Tensor> bf16;
  for (const auto& p : reference_params) {
    bf16.push_back(p.detach().to(torch::kBFloat16).to(torch::kFloat32).requires_grad_());
  }
  const auto low = [&] {
    std::vector<at::Tensor> out;
    for (const auto& p : bf16) out.push_back(p.detach().to(torch::kBFloat16).requires_grad_());
    return out;
  }();
  AdamW reference(groups_of(bf16, false));
  mdist::optim::FusedAdamW fused(groups_of(low, false));
  for (int step = 0; step < 5; ++step) {
    set_gradients(step, bf16, low);
    reference.step();
    fused.step();
  }
  for (std::size_t i = 0; i < bf16.size(); ++i) {
    EXPECT_LE(max_rel(low[i], bf16[i]), 2e-2) << i;  // a few bf16 roundings
  }
}

TEST(FusedAdamW, RefusesSparseGradients) {
  auto p = torch::zeros({4, 3}).requires_grad_();
  mdist::optim::FusedAdamW fused(std::vector<at::Tensor>{p});
  p.mutable_grad() = torch::zeros({4, 3}).to_sparse();
  try {
    fused.step();
    FAIL() << "no error";
  } catch (const mdist::Error& e) {
    EXPECT_NE(std::string(e.what()).find("sparse gradients"), std::string::npos);
  }
}

}  // namespace
