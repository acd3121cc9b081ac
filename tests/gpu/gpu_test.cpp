// What can only be checked with a CUDA device (run by scripts/gpu_check.sh on a GPU machine,
// through mdistrun; every test skips, saying why, on a machine or build without CUDA):
//   - the default backend is "cpu:gloo,cuda:nccl" and a CUDA tensor goes through NCCL;
//   - fully_shard computing on cuda:LOCAL_RANK matches single-process training on the CPU;
//   - bf16 param_dtype on CUDA keeps fp32 shards and gradients and tracks the fp32 reference;
//   - CPU offload: pinned CPU shards, compute on the device, the optimizer on the CPU.
#include <gtest/gtest.h>

#include <torch/cuda.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/mdist.h"
#include "mdist/runtime/c10d.h"
#include "tests/fsdp/mlp.h"
#include "tests/fsdp/mlp_reference.h"

namespace {

using mdist::testing::Mlp;

#define MDIST_REQUIRE_CUDA()                                                                       \
  do {                                                                                             \
    if (!mdist::nccl_compiled()) GTEST_SKIP() << "mdist built without CUDA (MDIST_WITH_CUDA=OFF)"; \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";                    \
  } while (false)

using mdist::testing::adamw;
using mdist::testing::Data;
using mdist::testing::kSteps;
using mdist::testing::local_batch;
using mdist::testing::rel_diff;
using mdist::testing::seeded_model;
using mdist::testing::Trace;

// The single-process reference trains on the CPU.
Trace train_reference_on_cpu() { return mdist::testing::train_reference(); }

enum class Placement { kOnDevice, kCpuOffload };

// Wraps fc1, fc2 and the root, trains kSteps on this rank's share of the global batch, and
// returns the global losses and the full parameters. `check` runs after each backward.
template <typename Check>
Trace train_sharded(Placement placement, const mdist::MixedPrecisionPolicy& mp, Check&& check) {
  const c10::Device device = mdist::compute_device();
  Mlp model = seeded_model();
  if (placement == Placement::kOnDevice) model->to(device);
  mdist::FullyShardOptions options;
  options.mp_policy = mp;
  if (placement == Placement::kCpuOffload) options.offload_policy = mdist::CPUOffloadPolicy{};
  std::vector<mdist::FsdpHandle> units;
  units.push_back(mdist::fully_shard(*model->fc1, options));
  units.push_back(mdist::fully_shard(*model->fc2, options));
  units.push_back(mdist::fully_shard(*model, options));

  torch::optim::AdamW opt(model->parameters(), adamw());
  Trace trace;
  for (int step = 0; step < kSteps; ++step) {
    const Data d = local_batch(step, device);
    opt.zero_grad();
    const at::Tensor out = model->forward(d.x);
    EXPECT_EQ(out.device(), device) << "the forward ran off the compute device";
    const at::Tensor loss = torch::mse_loss(out.to(torch::kFloat32), d.y);
    loss.backward();
    check(*model);
    opt.step();
    trace.losses.push_back(mdist::allreduce(loss.item<double>()) / mdist::size());
  }
  for (auto& unit : units) unit.unshard();
  for (const auto& p : model->named_parameters())
    trace.params[p.key()] = p.value().detach().to(torch::kCPU).clone();
  return trace;
}

void expect_close(const Trace& got, const Trace& want, double loss_tol, double param_tol) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (std::size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], loss_tol * std::abs(want.losses[i])) << "step " << i;
  }
  for (const auto& [name, expected] : want.params) {
    ASSERT_TRUE(got.params.contains(name)) << name;
    EXPECT_LT(rel_diff(got.params.at(name).to(torch::kFloat32), expected), param_tol) << name;
  }
}

class Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    // TF32 would round fp32 matmuls to 10 mantissa bits: not what the CPU reference does.
    at::globalContext().setAllowTF32CuBLAS(false);
    at::globalContext().setAllowTF32CuDNN(false);
  }
};

TEST_F(Gpu, DefaultBackendIsNcclForCudaAndGlooForCpu) {
  MDIST_REQUIRE_CUDA();
  ASSERT_TRUE(mdist::backend().has_value());
  EXPECT_EQ(*mdist::backend(), "cpu:gloo,cuda:nccl");
  const c10::Device device = mdist::compute_device();
  EXPECT_TRUE(device.is_cuda()) << device;

  // One all-reduce through each backend of the default group.
  for (const c10::Device on : {device, c10::Device(c10::kCPU)}) {
    std::vector<at::Tensor> tensors{
        torch::full({4}, mdist::rank() + 1.0, torch::dtype(torch::kFloat32).device(on))};
    mdist::wait(mdist::process_group(mdist::Group::world())->allreduce(tensors),
                mdist::Group::world(), "allreduce");
    const double world = mdist::size();
    EXPECT_EQ(tensors[0].to(torch::kCPU)[0].item<double>(), world * (world + 1) / 2) << on;
  }
}

TEST_F(Gpu, FullyShardOnCudaMatchesSingleProcessCpuTraining) {
  MDIST_REQUIRE_CUDA();
  const Trace got = train_sharded(Placement::kOnDevice, {}, [](mdist::testing::MlpImpl& model) {
    for (const auto& p : model.parameters()) {
      EXPECT_TRUE(p.is_cuda());
      EXPECT_TRUE(p.grad().defined() && p.grad().is_cuda());
    }
  });
  expect_close(got, train_reference_on_cpu(), 1e-5, 1e-4);
}

TEST_F(Gpu, Bf16ParamDtypeKeepsFp32ShardsAndTracksTheFp32Reference) {
  MDIST_REQUIRE_CUDA();
  mdist::MixedPrecisionPolicy mp;
  mp.param_dtype = torch::kBFloat16;
  mp.reduce_dtype = torch::kFloat32;
  const Trace got = train_sharded(Placement::kOnDevice, mp, [](mdist::testing::MlpImpl& model) {
    for (const auto& p : model.parameters()) {
      EXPECT_EQ(p.scalar_type(), torch::kFloat32);
      EXPECT_EQ(p.grad().scalar_type(), torch::kFloat32);
    }
  });
  // bf16 keeps 8 mantissa bits: within a few percent of the fp32 run over 5 steps.
  expect_close(got, train_reference_on_cpu(), 3e-2, 5e-2);
}

TEST_F(Gpu, CpuOffloadKeepsPinnedShardsOnTheCpuAndComputesOnTheDevice) {
  MDIST_REQUIRE_CUDA();
  const Trace got = train_sharded(Placement::kCpuOffload, {}, [](mdist::testing::MlpImpl& model) {
    for (const auto& p : model.parameters()) {
      EXPECT_TRUE(p.is_cpu());
      EXPECT_TRUE(p.is_pinned()) << "offloaded shard not in pinned memory";
      ASSERT_TRUE(p.grad().defined());
      EXPECT_TRUE(p.grad().is_cpu()) << "the optimizer must step on the CPU";
    }
  });
  expect_close(got, train_reference_on_cpu(), 1e-5, 1e-4);
}

}  // namespace
