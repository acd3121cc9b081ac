// Which device a rank computes on: select_compute_device from what it sees (CUDA devices,
// local rank, ranks per node), and compute_device() for this process.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/cuda.h>

#include "mdist/error.h"
#include "mdist/runtime/device.h"
#include "mdist/runtime/runtime.h"
#include "tests/support/error_of.h"

namespace {

using mdist::testing::error_of;
using ::testing::HasSubstr;

const c10::Device kCpu(c10::kCPU);

c10::Device cuda(int index) {
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

TEST(DevicePolicy, WithoutCudaEveryLocalRankComputesOnTheCpu) {
  for (const int local_rank : {0, 3}) {
    EXPECT_EQ(mdist::select_compute_device(
                  {.cuda_device_count = 0, .local_rank = local_rank, .local_size = 4}),
              kCpu)
        << "LOCAL_RANK " << local_rank;
  }
  EXPECT_EQ(mdist::select_compute_device({}), kCpu);  // a plain process on a CPU machine
}

TEST(DevicePolicy, EachLocalRankTakesTheDeviceOfItsIndex) {
  EXPECT_EQ(
      mdist::select_compute_device({.cuda_device_count = 8, .local_rank = 3, .local_size = 8}),
      cuda(3));
  EXPECT_EQ(
      mdist::select_compute_device({.cuda_device_count = 8, .local_rank = 0, .local_size = 8}),
      cuda(0));
  EXPECT_EQ(
      mdist::select_compute_device({.cuda_device_count = 8, .local_rank = 7, .local_size = 8}),
      cuda(7));
}

TEST(DevicePolicy, ASingleVisibleDeviceIsTheRanksOwn) {
  // One device per rank (e.g. CUDA_VISIBLE_DEVICES set per rank): whatever the local rank,
  // the one device it sees is cuda:0.
  EXPECT_EQ(
      mdist::select_compute_device({.cuda_device_count = 1, .local_rank = 5, .local_size = 8}),
      cuda(0));
  EXPECT_EQ(
      mdist::select_compute_device({.cuda_device_count = 1, .local_rank = 0, .local_size = 1}),
      cuda(0));
}

TEST(DevicePolicy, MoreLocalRanksThanDevicesIsAnError) {
  // Two devices, four ranks on the node: ranks 2 and 3 would silently share a device (or all
  // land on cuda:0), so it is refused, naming the rank and the device count.
  const std::string error = error_of([] {
    static_cast<void>(
        mdist::select_compute_device({.cuda_device_count = 2, .local_rank = 3, .local_size = 4}));
  });
  EXPECT_THAT(error, HasSubstr("LOCAL_RANK 3"));
  EXPECT_THAT(error, HasSubstr("2 CUDA device"));
}

TEST(DevicePolicy, ComputeDeviceOfThisProcess) {
  const int devices = static_cast<int>(torch::cuda::device_count());
  if (devices == 0) {
    EXPECT_EQ(mdist::compute_device(), kCpu);  // this CPU-only machine
  } else {
    EXPECT_EQ(mdist::compute_device(),
              mdist::select_compute_device({.cuda_device_count = devices,
                                            .local_rank = mdist::local_rank(),
                                            .local_size = mdist::local_size()}));
  }
}

}  // namespace
