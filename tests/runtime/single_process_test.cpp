// A plain process (no launcher variables): exactly the spec's not-initialized behaviour.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>

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
  EXPECT_THAT(error_of([] { mdist::broadcast(1, 1); }),
              HasSubstr("broadcast: src 1 is out of range for the world of size 1"));
  EXPECT_THAT(error_of([] { mdist::allreduce(1, "avg"); }),
              HasSubstr("unsupported op 'avg' (supported: sum, max, min)"));
}

TEST_F(SingleProcess, DistributedProcessGroup) {
  const mdist::DistributedProcessGroup world;
  EXPECT_TRUE(world.is_initialized());
  EXPECT_EQ(world.rank(), 0);
  EXPECT_EQ(world.world_size(), 1);
  EXPECT_EQ(world.to_string(), "DistributedProcessGroup(group=world, rank=0, world_size=1)");
  const mdist::DistributedProcessGroup unused(mdist::Group::not_used());
  EXPECT_FALSE(unused.is_initialized());
  EXPECT_EQ(unused.rank(), -1);
  EXPECT_EQ(unused.world_size(), -1);
  EXPECT_EQ(unused.to_string(), "DistributedProcessGroup(group=not used, rank=-1, world_size=-1)");
  // The op sees the gathered list of one; unused groups are skipped.
  const auto twice = [](const std::vector<int>& values) { return values.at(0) * 2; };
  EXPECT_EQ(mdist::DistributedProcessGroup::get_dist_syncd_obj(3, {world, unused, world}, twice),
            12);
  EXPECT_EQ(mdist::DistributedProcessGroup::get_dist_syncd_obj(3, unused, twice), 3);
}

TEST_F(SingleProcess, ParallelStateDefaultsFollowTheSpec) {
  const mdist::ParallelState state;
  EXPECT_TRUE(state.data_parallel_group.group().is_world());
  EXPECT_FALSE(state.tensor_parallel_group.is_initialized());
  EXPECT_FALSE(state.expert_model_parallel_group.is_initialized());
  EXPECT_EQ(state.to_string(),
            "ParallelState(data_parallel_group=DistributedProcessGroup(group=world, rank=0, "
            "world_size=1), tensor_parallel_group=DistributedProcessGroup(group=not used, "
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

TEST(ParallelLayout, MegatronOrder) {
  const auto layout = mdist::parallel_layout(8, {.tensor_parallel = 2, .expert_model_parallel = 2});
  using G = std::vector<std::vector<int>>;
  EXPECT_EQ(layout.data_parallel, 4);
  EXPECT_EQ(layout.tensor_parallel_groups, (G{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(layout.data_parallel_groups, (G{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(layout.expert_model_parallel_groups, (G{{0, 2}, {4, 6}, {1, 3}, {5, 7}}));
  const auto plain = mdist::parallel_layout(3, {});
  EXPECT_EQ(plain.data_parallel_groups, (G{{0, 1, 2}}));
  EXPECT_EQ(plain.tensor_parallel_groups, (G{{0}, {1}, {2}}));
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
