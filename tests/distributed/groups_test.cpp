// Subgroups, DistributedProcessGroup and ParallelState across real ranks (1-4 ranks).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "mdist/mdist.h"
#include "tests/support/error_of.h"

namespace {

using ::testing::HasSubstr;

using mdist::testing::error_of;

const auto kMax = [](const std::vector<double>& values) {
  return *std::max_element(values.begin(), values.end());
};

TEST(Groups, UnevenSubgroupsInGivenOrder) {
  const int world = mdist::size();
  const int me = mdist::rank();
  // Ranks in reverse order: group rank i is global rank world-1-i. Then every even rank,
  // a group the odd ranks are not in.
  std::vector<int> reversed;
  for (int r = world - 1; r >= 0; --r) reversed.push_back(r);
  const mdist::Group backwards = mdist::new_group(reversed);
  std::vector<int> evens;
  for (int r = 0; r < world; r += 2) evens.push_back(r);
  const mdist::Group even = mdist::new_group(evens, std::chrono::seconds(30));

  EXPECT_TRUE(backwards.is_member());
  EXPECT_EQ(backwards.ranks(), reversed);
  EXPECT_EQ(mdist::size(backwards), world);
  EXPECT_EQ(mdist::rank(backwards), world - 1 - me);
  EXPECT_EQ(mdist::is_master(backwards), me == world - 1);
  EXPECT_EQ(mdist::allgather(me, backwards), reversed);
  EXPECT_EQ(even.timeout(), std::chrono::seconds(30));

  EXPECT_EQ(even.is_member(), me % 2 == 0);
  if (me % 2 == 0) {
    EXPECT_EQ(mdist::size(even), static_cast<int>(evens.size()));
    EXPECT_EQ(mdist::rank(even), me / 2);
    EXPECT_EQ(mdist::allgather(me * 10, even).size(), evens.size());
    EXPECT_EQ(mdist::broadcast(me, evens.back(), even), evens.back());
    EXPECT_EQ(mdist::master_only([&] { return me; }, even), 0);
    mdist::barrier(even);
  } else {
    // torch.distributed's convention outside a group: rank and size -1, barrier returns.
    EXPECT_EQ(mdist::rank(even), -1);
    EXPECT_EQ(mdist::size(even), -1);
    EXPECT_FALSE(mdist::is_master(even));
    EXPECT_FALSE(mdist::is_last_process(even));
    mdist::barrier(even);
    const mdist::DistributedProcessGroup outside(even);
    EXPECT_TRUE(outside.is_initialized());
    EXPECT_EQ(outside.rank(), -1);
    EXPECT_EQ(outside.world_size(), -1);
    // all_gather_object does nothing outside the group, so the reference calls op on [].
    const auto count = [](const std::vector<int>& values) {
      return static_cast<int>(values.size());
    };
    EXPECT_EQ(mdist::DistributedProcessGroup::get_dist_syncd_obj(7, outside, count), 0);
    // Collectives that move data cannot, and say so.
    const std::string who = "rank " + std::to_string(me) + " is not a member of this group";
    EXPECT_THAT(error_of([&] { mdist::allgather(1, even); }),
                HasSubstr("allgather on " + even.name() + ": " + who));
    EXPECT_THAT(error_of([&] { mdist::broadcast(1, 0, even); }), HasSubstr("not a member"));
  }
  if (world > 1) {
    EXPECT_THAT(error_of([&] { mdist::broadcast(1, 1, even); }),
                HasSubstr("broadcast: src 1 is not a member of " + even.name()));
  }
  mdist::barrier();
}

TEST(Groups, BadRankListsAreRejectedOnEveryRank) {
  const int world = mdist::size();
  EXPECT_THAT(error_of([] { mdist::new_group({}); }),
              HasSubstr("new_group: the rank list is empty"));
  EXPECT_THAT(error_of([&] {
                mdist::new_group({0, world});
              }),
              HasSubstr("rank " + std::to_string(world) + " is out of range for world size " +
                        std::to_string(world)));
  EXPECT_THAT(error_of([] { mdist::new_group({0, -1}); }), HasSubstr("rank -1 is out of range"));
  EXPECT_THAT(error_of([] {
                mdist::new_group({0, 0});
              }),
              HasSubstr("new_group [0, 0]: rank 0 appears twice"));
  // Rejected calls made no group, so the next one still matches on every rank.
  const mdist::Group all = mdist::new_group(mdist::Group::world().ranks());
  EXPECT_EQ(mdist::allreduce(1, "sum", all), world);
}

TEST(ParallelState, FactoryLayoutMatchesMegatron) {
  const int world = mdist::size();
  const int me = mdist::rank();
  for (const int tp : {1, 2, 3, 4}) {
    if (world % tp != 0) continue;
    const auto state = mdist::make_parallel_state({.tensor_parallel = tp});
    const auto layout = mdist::parallel_layout(world, {.tensor_parallel = tp});
    if (tp == 1) {
      EXPECT_FALSE(state.tensor_parallel_group.is_initialized());
      EXPECT_EQ(state.tensor_parallel_group.rank(), -1);
    } else {
      EXPECT_EQ(state.tensor_parallel_group.group().ranks(),
                layout.tensor_parallel_groups[me / tp]);
      EXPECT_EQ(state.tensor_parallel_group.rank(), me % tp);
      EXPECT_EQ(state.tensor_parallel_group.world_size(), tp);
    }
    EXPECT_EQ(state.data_parallel_group.group().ranks(), layout.data_parallel_groups[me % tp]);
    EXPECT_EQ(state.data_parallel_group.world_size(), world / tp);
    EXPECT_EQ(state.data_parallel_group.rank(), me / tp);
    EXPECT_FALSE(state.expert_model_parallel_group.is_initialized());

    // Calibration's amax sync: max over data parallel, then tensor parallel.
    const double amax = mdist::DistributedProcessGroup::get_dist_syncd_obj(
        0.5 * me, {state.data_parallel_group, state.tensor_parallel_group}, kMax);
    EXPECT_DOUBLE_EQ(amax, 0.5 * (world - 1)) << "tp " << tp;
    // Only data parallel: the max within this rank's data-parallel group.
    const double dp_amax = mdist::DistributedProcessGroup::get_dist_syncd_obj(
        0.5 * me, state.data_parallel_group, kMax);
    EXPECT_DOUBLE_EQ(dp_amax, 0.5 * layout.data_parallel_groups[me % tp].back());
  }
}

TEST(ParallelState, ExpertParallelGroups) {
  const int world = mdist::size();
  if (world % 2 != 0) GTEST_SKIP() << "needs an even world";
  const int me = mdist::rank();
  const auto state = mdist::make_parallel_state({.tensor_parallel = 1, .expert_model_parallel = 2});
  EXPECT_TRUE(state.data_parallel_group.group().is_world());
  EXPECT_EQ(state.expert_model_parallel_group.group().ranks(),
            (std::vector<int>{me - me % 2, me - me % 2 + 1}));
  const auto gathered = mdist::DistributedProcessGroup::get_dist_syncd_obj(
      me, state.expert_model_parallel_group, [](const std::vector<int>& v) { return v[0] + v[1]; });
  EXPECT_EQ(gathered, 2 * (me - me % 2) + 1);
  EXPECT_THAT(error_of([&] { mdist::make_parallel_state({.tensor_parallel = world + 1}); }),
              HasSubstr("is not divisible by tensor_parallel"));
}

TEST(ParallelState, StringForm) {
  const mdist::ParallelState state;
  EXPECT_EQ(state.data_parallel_group.to_string(),
            "DistributedProcessGroup(group=world, rank=" + std::to_string(mdist::rank()) +
                ", world_size=" + std::to_string(mdist::size()) + ")");
}

}  // namespace
