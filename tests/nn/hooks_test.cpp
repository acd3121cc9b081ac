// Forward hooks through mdist::nn::call and mdist::nn::hooked.
#include "mdist/nn/hooks.h"

#include <gtest/gtest.h>

#include <cstdio>

#include <torch/torch.h>

namespace {

// A module whose own forward is hookable, with a child it calls through call().
struct OuterImpl : torch::nn::Module {
  OuterImpl() { inner = register_module("inner", torch::nn::Linear(3, 3)); }
  at::Tensor forward(const at::Tensor& x) { return mdist::nn::hooked(*this, &OuterImpl::body, x); }
  at::Tensor body(const at::Tensor& x) { return mdist::nn::call(inner, x) * 2; }
  torch::nn::Linear inner{nullptr};
};
TORCH_MODULE(Outer);

TEST(Hooks, RunAroundCallAndCanReplaceTensors) {
  Outer outer;
  std::vector<std::string> log;
  auto pre = mdist::nn::register_forward_pre_hook(*outer->inner, [&](torch::nn::Module&, auto& in) {
    log.push_back("pre");
    *in.at(0) = at::zeros_like(*in.at(0));  // the child now sees zeros
  });
  auto post = mdist::nn::register_forward_hook(*outer->inner, [&](torch::nn::Module&, auto& out) {
    log.push_back("post");
    *out.at(0) = *out.at(0) + 1;
  });
  const at::Tensor x = torch::randn({2, 3});
  const at::Tensor y = outer->forward(x);
  EXPECT_EQ(log, (std::vector<std::string>{"pre", "post"}));
  EXPECT_TRUE(at::allclose(y, (outer->inner->bias.expand({2, 3}) + 1) * 2));
  pre.remove();
  post.remove();
  EXPECT_FALSE(mdist::nn::has_hooks(*outer->inner));
  EXPECT_TRUE(at::allclose(outer->forward(x), outer->inner->forward(x) * 2));
}

TEST(Hooks, AHookedForwardReachedThroughCallRunsItsHooksOnce) {
  Outer outer;
  int calls = 0;
  auto pre =
      mdist::nn::register_forward_pre_hook(*outer, [&](torch::nn::Module&, auto&) { ++calls; });
  outer->forward(torch::randn({1, 3}));  // called directly: hooked() runs the hooks
  EXPECT_EQ(calls, 1);
  mdist::nn::call(outer, torch::randn({1, 3}));  // call() then forward's hooked(): still once
  EXPECT_EQ(calls, 2);
  pre.remove();
}

// A Linear called through call() computes as PyTorch's nn.Linear (at::linear: for a 3-D input
// with a bias, one addmm over the rows, one rounding), not as libtorch's LinearImpl::forward
// (the product rounded to bf16, then the bias added): in bf16 the two differ, and that was
// the first difference of mdist's bf16 forward from PyTorch's (docs/quantization.md). With a
// pre-hook the weight it swaps in is the one used.
TEST(Hooks, ALinearComputesAsPyTorchsLinear) {
  torch::manual_seed(0);
  torch::nn::Linear linear(torch::nn::LinearOptions(32, 48).bias(true));
  linear->to(at::kBFloat16);
  {
    const at::NoGradGuard no_grad;
    linear->bias.normal_();  // of the size of the products, so that the roundings matter
  }
  const at::Tensor x = torch::randn({4, 16, 32}).to(at::kBFloat16);
  const at::Tensor y = mdist::nn::call(linear, x);
  EXPECT_TRUE(at::equal(y, at::linear(x, linear->weight, linear->bias)));
  const int64_t differing = y.ne(linear->forward(x)).sum().item<int64_t>();
  EXPECT_GT(differing, y.numel() / 10) << "libtorch's LinearImpl::forward rounds as at::linear";
  std::printf("[ measured ] bf16 Linear: %lld of %lld elements differ from LinearImpl::forward\n",
              static_cast<long long>(differing), static_cast<long long>(y.numel()));
  linear->to(at::kFloat);
  const at::Tensor zero = at::zeros_like(linear->weight);
  auto pre = mdist::nn::register_forward_pre_hook(*linear, [&](torch::nn::Module& m, auto&) {
    static_cast<torch::nn::LinearImpl&>(m).weight = zero;
  });
  EXPECT_TRUE(
      at::equal(mdist::nn::call(linear, x.to(at::kFloat)), linear->bias.expand({4, 16, 48})));
  pre.remove();
}

TEST(Hooks, ADeadModulesHooksDoNotPassToANewOneAtItsAddress) {
  int calls = 0;
  const torch::nn::Module* address = nullptr;
  {
    auto linear = std::make_shared<torch::nn::LinearImpl>(2, 2);
    address = linear.get();
    mdist::nn::register_forward_pre_hook(*linear, [&](torch::nn::Module&, auto&) { ++calls; });
  }
  // Whatever lives at that address now, it has no hooks.
  auto fresh = std::make_shared<torch::nn::LinearImpl>(2, 2);
  if (fresh.get() == address) {
    EXPECT_FALSE(mdist::nn::has_hooks(*fresh));
  }
  mdist::nn::call(fresh, torch::randn({1, 2}));
  EXPECT_EQ(calls, 0);
}

// A module whose forward throws when asked to: the exception-safety path of the hooks.
struct FlakyImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) { return mdist::nn::hooked(*this, &FlakyImpl::body, x); }
  at::Tensor body(const at::Tensor& x) {
    if (fail) throw std::runtime_error("forward failed");
    return x + 1;
  }
  bool fail = false;
};
TORCH_MODULE(Flaky);

TEST(Hooks, ErrorHooksRunWhenTheForwardOrAPostHookThrowsAndTheErrorPropagates) {
  Flaky flaky;
  std::vector<std::string> log;
  bool post_throws = false;
  auto pre = mdist::nn::register_forward_pre_hook(
      *flaky, [&](torch::nn::Module&, auto&) { log.push_back("pre"); });
  auto post = mdist::nn::register_forward_hook(*flaky, [&](torch::nn::Module&, auto&) {
    log.push_back("post");
    if (post_throws) throw std::runtime_error("post-hook failed");
  });
  auto error = mdist::nn::register_forward_error_hook(
      *flaky, [&](torch::nn::Module&) { log.push_back("error"); });

  flaky->forward(torch::zeros({1}));
  EXPECT_EQ(log, (std::vector<std::string>{"pre", "post"}));  // no error hook on success

  log.clear();
  flaky->fail = true;
  EXPECT_THROW(
      {
        try {
          flaky->forward(torch::zeros({1}));
        } catch (const std::runtime_error& e) {
          EXPECT_STREQ(e.what(), "forward failed");
          throw;
        }
      },
      std::runtime_error);
  EXPECT_EQ(log, (std::vector<std::string>{"pre", "error"}));

  log.clear();
  flaky->fail = false;
  post_throws = true;
  EXPECT_THROW(mdist::nn::call(flaky, torch::zeros({1})), std::runtime_error);
  EXPECT_EQ(log, (std::vector<std::string>{"pre", "post", "error"}));

  // Removed, it no longer runs.
  log.clear();
  error.remove();
  flaky->fail = true;
  EXPECT_THROW(flaky->forward(torch::zeros({1})), std::runtime_error);
  EXPECT_EQ(log, (std::vector<std::string>{"pre"}));
  pre.remove();
  post.remove();
  EXPECT_FALSE(mdist::nn::has_hooks(*flaky));
}

}  // namespace
