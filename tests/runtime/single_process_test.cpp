// A plain process (no launcher variables): exactly the spec's not-initialized behaviour.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <ATen/ATen.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <thread>

#include "mdist/mdist.h"
#include "tests/support/error_of.h"

namespace {

using ::testing::HasSubstr;

class SingleProcess : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (const char* name :
         {"RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}) {
      ::unsetenv(name);
    }
    ASSERT_FALSE(mdist::setup(std::chrono::seconds(5)));
  }
};

using mdist::testing::error_of;

TEST_F(SingleProcess, SpecSemantics) {
  EXPECT_TRUE(mdist::is_available());
  EXPECT_FALSE(mdist::is_initialized());
  EXPECT_FALSE(mdist::backend().has_value());
  EXPECT_EQ(mdist::size(), 1);
  EXPECT_EQ(mdist::rank(), 0);
  EXPECT_EQ(mdist::local_rank(), 0);
  EXPECT_TRUE(mdist::is_master());
  EXPECT_TRUE(mdist::is_last_process());
  mdist::barrier();  // a no-op
  mdist::cleanup();  // safe when not initialized
  EXPECT_FALSE(mdist::launch_env().has_value());
}

TEST_F(SingleProcess, ObjectCollectivesReturnTheirInput) {
  const std::map<std::string, std::vector<double>> obj = {{"a", {1.0, 2.0}}};
  EXPECT_EQ(mdist::broadcast(obj), obj);
  EXPECT_EQ(mdist::allgather(obj), std::vector{obj});
  EXPECT_EQ(mdist::allreduce(7), 7);
  EXPECT_EQ(mdist::allreduce(std::string("x")), "x");
  EXPECT_EQ(mdist::master_only([] { return 42; }), 42);
  int calls = 0;
  mdist::master_only([&] { ++calls; });
  EXPECT_EQ(calls, 1);
  // As the reference (`if size() == 1: return obj`): no source or group is checked in a world
  // of one.
  EXPECT_EQ(mdist::broadcast(5, 1), 5);
  EXPECT_EQ(mdist::broadcast(std::string("kept"), 3, mdist::Group::not_used()), "kept");
  EXPECT_THAT(error_of([] { mdist::allreduce(1, "avg"); }),
              HasSubstr("unsupported op 'avg' (supported: sum, max, min)"));
}

TEST_F(SingleProcess, DistributedProcessGroup) {
  // The reference: is_initialized() is "the backend is up and the group is not -1", and rank()
  // and world_size() are -1 when it is false; so a plain process reports false, -1, -1 even
  // for the world.
  const mdist::DistributedProcessGroup world;
  EXPECT_FALSE(world.is_initialized());
  EXPECT_EQ(world.rank(), -1);
  EXPECT_EQ(world.world_size(), -1);
  EXPECT_EQ(world.to_string(), "DistributedProcessGroup(group=world, rank=-1, world_size=-1)");
  const mdist::DistributedProcessGroup unused(mdist::Group::not_used());
  EXPECT_FALSE(unused.is_initialized());
  EXPECT_EQ(unused.rank(), -1);
  EXPECT_EQ(unused.world_size(), -1);
  EXPECT_EQ(unused.to_string(), "DistributedProcessGroup(group=not used, rank=-1, world_size=-1)");
  // Groups that are not initialized leave the object untouched: op is never called.
  int calls = 0;
  const auto twice = [&](const std::vector<int>& values) {
    ++calls;
    return values.at(0) * 2;
  };
  EXPECT_EQ(mdist::DistributedProcessGroup::get_dist_syncd_obj(3, {world, unused, world}, twice),
            3);
  EXPECT_EQ(mdist::DistributedProcessGroup::get_dist_syncd_obj(3, unused, twice), 3);
  EXPECT_EQ(mdist::DistributedProcessGroup::get_dist_syncd_obj(3, world, twice), 3);
  EXPECT_EQ(calls, 0);
}

TEST_F(SingleProcess, ParallelStateDefaultsFollowTheSpec) {
  const mdist::ParallelState state;
  EXPECT_TRUE(state.data_parallel_group.group().is_world());
  EXPECT_FALSE(state.tensor_parallel_group.is_initialized());
  EXPECT_FALSE(state.expert_model_parallel_group.is_initialized());
  EXPECT_EQ(state.to_string(),
            "ParallelState(data_parallel_group=DistributedProcessGroup(group=world, rank=-1, "
            "world_size=-1), tensor_parallel_group=DistributedProcessGroup(group=not used, "
            "rank=-1, world_size=-1), expert_model_parallel_group=DistributedProcessGroup("
            "group=not used, rank=-1, world_size=-1))");
  const auto made = mdist::make_parallel_state({});
  EXPECT_TRUE(made.data_parallel_group.group().is_world());
  EXPECT_FALSE(made.tensor_parallel_group.is_initialized());
  EXPECT_THAT(error_of([] { mdist::make_parallel_state({.tensor_parallel = 2}); }),
              HasSubstr("world size 1 is not divisible by tensor_parallel 2"));
}

TEST_F(SingleProcess, GroupErrors) {
  EXPECT_THAT(error_of([] { mdist::rank(mdist::Group::not_used()); }),
              HasSubstr("rank on a 'not used' group"));
  EXPECT_THAT(error_of([] { mdist::new_group({0}); }),
              HasSubstr("new_group needs an initialized job; call setup() first"));
  EXPECT_THAT(error_of([] { mdist::allgather(1, mdist::Group::not_used()); }),
              HasSubstr("allgather on a 'not used' group"));
}

TEST(FileLock, TheReferencesProtocol) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("mdist-lock-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::filesystem::path path = dir / "out.lock";
  {
    mdist::FileLock first(path);
    EXPECT_TRUE(first.try_acquire());
    EXPECT_TRUE(first.held());
    EXPECT_TRUE(std::filesystem::exists(path));
    EXPECT_TRUE(first.try_acquire());  // already ours

    // all_acquire = false: one try, no wait.
    mdist::FileLock second(path);
    EXPECT_FALSE(second.acquire());
    EXPECT_FALSE(second.held());
    // Releasing a lock it does not hold leaves the holder's file (the reference removes it).
    second.release();
    EXPECT_TRUE(std::filesystem::exists(path));

    // all_acquire with a timeout: waits, then names the file.
    mdist::FileLock waiting(path, {.all_acquire = true,
                                   .poll_time = std::chrono::milliseconds(5),
                                   .timeout = std::chrono::milliseconds(60)});
    EXPECT_THAT(error_of([&] { waiting.acquire(); }),
                HasSubstr("FileLock: " + path.string() + " is still held after 60 ms"));

    first.release();
    EXPECT_FALSE(std::filesystem::exists(path));
    EXPECT_TRUE(second.try_acquire());
  }  // second's destructor releases
  EXPECT_FALSE(std::filesystem::exists(path));

  // all_acquire waits for a holder that releases.
  auto holder = std::make_unique<mdist::FileLock>(path);
  ASSERT_TRUE(holder->try_acquire());
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    holder.reset();
  });
  mdist::FileLock patient(path, {.all_acquire = true, .poll_time = std::chrono::milliseconds(2)});
  EXPECT_TRUE(patient.acquire());
  releaser.join();
  patient.release();

  EXPECT_THAT(error_of([&] { mdist::FileLock(dir / "missing" / "x.lock").try_acquire(); }),
              HasSubstr("FileLock: cannot create " + (dir / "missing" / "x.lock").string() +
                        ": No such file or directory"));
  EXPECT_THAT(error_of([&] { mdist::FileLock(path, {.poll_time = std::chrono::milliseconds(0)}); }),
              HasSubstr("poll_time must be positive, got 0 ms"));
  std::filesystem::remove_all(dir);
}

TEST_F(SingleProcess, BroadcastStateDictReturnsTheDict) {
  const std::map<std::string, at::Tensor> dict = {{"w", at::ones({2, 3})}, {"n", at::arange(4)}};
  const auto got = mdist::broadcast_state_dict(&dict, 0, at::kCPU);
  ASSERT_EQ(got.size(), 2U);
  EXPECT_TRUE(got.at("w").is_same(dict.at("w")));
  EXPECT_TRUE(at::equal(got.at("n"), dict.at("n")));
  EXPECT_THAT(error_of([] { mdist::broadcast_state_dict(nullptr, 0, at::kCPU); }),
              HasSubstr("broadcast_state_dict: src rank 0 passed no state dict to broadcast"));
}

TEST(ParallelLayout, MegatronOrder) {
  const auto layout = mdist::parallel_layout(8, {.tensor_parallel = 2, .expert_model_parallel = 2});
  using G = std::vector<std::vector<int>>;
  EXPECT_EQ(layout.data_parallel, 4);
  EXPECT_EQ(layout.tensor_parallel_groups, (G{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(layout.data_parallel_groups, (G{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(layout.expert_model_parallel_groups, (G{{0, 2}, {4, 6}, {1, 3}, {5, 7}}));
  // Same position in their expert-parallel chunks of one data-parallel group.
  EXPECT_EQ(layout.expert_data_parallel_groups, (G{{0, 4}, {2, 6}, {1, 5}, {3, 7}}));
  const auto plain = mdist::parallel_layout(3, {});
  EXPECT_EQ(plain.data_parallel_groups, (G{{0, 1, 2}}));
  EXPECT_EQ(plain.tensor_parallel_groups, (G{{0}, {1}, {2}}));
  EXPECT_EQ(plain.expert_data_parallel_groups, (G{{0, 1, 2}}));
}

TEST(ParallelLayout, SizesThatDoNotFit) {
  EXPECT_THAT(error_of([] { mdist::parallel_layout(6, {.tensor_parallel = 4}); }),
              HasSubstr("world size 6 is not divisible by tensor_parallel 4"));
  EXPECT_THAT(
      error_of(
          [] { mdist::parallel_layout(8, {.tensor_parallel = 2, .expert_model_parallel = 3}); }),
      HasSubstr("data parallel size 4 (world size 8 / tensor_parallel 2) is not divisible by "
                "expert_model_parallel 3"));
  EXPECT_THAT(error_of([] { mdist::parallel_layout(4, {.tensor_parallel = 0}); }),
              HasSubstr("tensor_parallel must be at least 1, got 0"));
}

}  // namespace
