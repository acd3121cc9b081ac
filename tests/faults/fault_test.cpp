// Faults a user meets, each checked for its one-line message, exit code and bounded time.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <future>

#include "tests/support/subprocess.h"

namespace {

using mdist::testing::run;
using mdist::testing::RunOptions;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using namespace std::chrono_literals;

const std::string kProbe = MDIST_FAULT_PROBE;
const std::string kLauncher = MDIST_LAUNCHER;

RunOptions torchrun_env(int rank, int world, int port) {
  RunOptions options;
  options.env = {{"RANK", std::to_string(rank)},
                 {"WORLD_SIZE", std::to_string(world)},
                 {"MASTER_ADDR", "127.0.0.1"},
                 {"MASTER_PORT", std::to_string(port)}};
  return options;
}

TEST(BadEnvironment, WorldSizeNotANumber) {
  auto options = torchrun_env(0, 1, mdist::testing::free_port());
  options.env["WORLD_SIZE"] = "abc";
  const auto result = run({kProbe, "setup"}, options);
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_EQ(result.err, "mdist: invalid WORLD_SIZE='abc': expected a positive integer\n");
}

TEST(BadEnvironment, RankNotBelowWorldSize) {
  const auto result = run({kProbe, "setup"}, torchrun_env(2, 2, mdist::testing::free_port()));
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_EQ(result.err, "mdist: RANK=2 is out of range for WORLD_SIZE=2 (ranks are 0..1)\n");
}

TEST(BadEnvironment, MasterPortInUse) {
  const mdist::testing::HeldPort held;
  const auto result = run({kProbe, "setup"}, torchrun_env(0, 1, held.port()));
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_EQ(result.err, "mdist: rank 0 cannot listen on MASTER_PORT " +
                            std::to_string(held.port()) +
                            " (127.0.0.1): Address already in use (another job or program holds "
                            "it; pick a free port)\n");
}

TEST(MissingPeer, RankZeroWaitsOnlyUntilTheTimeout) {
  const int port = mdist::testing::free_port();
  const auto result = run({kProbe, "setup", "1500"}, torchrun_env(0, 2, port));
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(result.err,
              StartsWith("mdist: setup failed after 1500 ms: rank 0 waited at 127.0.0.1:" +
                         std::to_string(port) + " for all 2 ranks to join ("));
  EXPECT_LT(result.elapsed, 20s);
}

TEST(MissingPeer, AWorkerWithoutAMaster) {
  const int port = mdist::testing::free_port();
  const auto result = run({kProbe, "setup", "1500"}, torchrun_env(1, 2, port));
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(result.err, StartsWith("mdist: setup failed after 1500 ms: rank 1 could not join the "
                                     "store at 127.0.0.1:" +
                                     std::to_string(port)));
  EXPECT_LT(result.elapsed, 20s);
}

TEST(Collectives, APeerThatNeverCallsTimesOut) {
  const auto result =
      run({kLauncher, "--nproc-per-node", "2", kProbe, "collective-timeout", "1000"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(result.err,
              HasSubstr("[rank0]: mdist: allgather on world failed on rank 0 (timeout 1000 ms): "));
  EXPECT_LT(result.elapsed, 15s);  // the sleeping rank is ended by the launcher
}

TEST(Collectives, ACrashedPeerIsReportedNotAwaited) {
  const auto result = run({kLauncher, "--nproc-per-node", "2", kProbe, "peer-crash", "60000"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(
      result.err,
      HasSubstr("[rank0]: mdist: allgather on world failed on rank 0 (timeout 60000 ms): "));
  EXPECT_LT(result.elapsed, 30s);
}

TEST(Groups, UsingADestroyedGroup) {
  const auto result = run({kLauncher, "--nproc-per-node", "2", kProbe, "destroyed-group"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(result.err, HasSubstr("mdist: allgather on group 1 [0, 1], which was destroyed by "
                                    "cleanup()"));
}

TEST(Groups, UsingAShardedModelAfterItsGroupWasDestroyed) {
  const auto result = run({kLauncher, "--nproc-per-node", "2", kProbe, "fsdp-after-cleanup"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(result.err, HasSubstr("mdist: fully_shard: the model is sharded over the world (2 "
                                    "ranks), whose process group was destroyed by cleanup()"));
}

TEST(Lifecycle, AbortEndsTheJobWithItsCode) {
  const auto result = run({kLauncher, "--nproc-per-node", "2", kProbe, "abort"});
  EXPECT_EQ(result.exit_code, 7);
  EXPECT_LT(result.elapsed, 20s);
}

TEST(Lifecycle, CleanupSkipsTheBarrierWhileAnExceptionUnwinds) {
  const auto result =
      run({kLauncher, "--nproc-per-node", "2", kProbe, "exception-in-session", "60000"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(result.err, HasSubstr("[rank0]: boom on rank 0\n"));
  EXPECT_LT(result.elapsed, 20s);  // not the 60 s barrier timeout
}

// torchrun accepts an IPv6 MASTER_ADDR; rank 0 then binds the store on IPv6 and the rest join.
TEST(Rendezvous, AnIpv6MasterAddressJoins) {
  const int port = mdist::testing::free_port();
  std::vector<std::future<mdist::testing::RunResult>> ranks;
  for (int r = 0; r < 2; ++r) {
    RunOptions options = torchrun_env(r, 2, port);
    options.env["MASTER_ADDR"] = "::1";
    ranks.push_back(std::async(std::launch::async, [options] {
      return run({kProbe, "setup"}, options);
    }));
  }
  for (int r = 0; r < 2; ++r) {
    const auto result = ranks[r].get();
    EXPECT_EQ(result.exit_code, 0) << result.err;
    EXPECT_THAT(result.out, StartsWith("joined rank " + std::to_string(r) + " of 2 via "));
    EXPECT_THAT(result.out, EndsWith(" sum 1\n"));
  }
}

// One binary runs unchanged under other launchers: their variables, two real processes.
void expect_joins_under(const std::string& launcher,
                        const std::function<std::map<std::string, std::string>(int)>& vars) {
  const int port = mdist::testing::free_port();
  std::vector<std::future<mdist::testing::RunResult>> ranks;
  for (int r = 0; r < 2; ++r) {
    RunOptions options;
    options.env = vars(r);
    options.env["MASTER_ADDR"] = "127.0.0.1";
    options.env["MASTER_PORT"] = std::to_string(port);
    ranks.push_back(std::async(std::launch::async, [options] {
      return run({kProbe, "setup"}, options);
    }));
  }
  for (int r = 0; r < 2; ++r) {
    const auto result = ranks[r].get();
    EXPECT_EQ(result.exit_code, 0) << result.err;
    EXPECT_EQ(result.out,
              "joined rank " + std::to_string(r) + " of 2 via " + launcher + " sum 1\n");
  }
}

TEST(Launchers, OpenMPI) {
  expect_joins_under("Open MPI", [](int r) {
    return std::map<std::string, std::string>{{"OMPI_COMM_WORLD_RANK", std::to_string(r)},
                                              {"OMPI_COMM_WORLD_SIZE", "2"},
                                              {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r)},
                                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  });
}

TEST(Launchers, PMI) {
  expect_joins_under("PMI", [](int r) {
    return std::map<std::string, std::string>{{"PMI_RANK", std::to_string(r)}, {"PMI_SIZE", "2"}};
  });
}

TEST(Launchers, Slurm) {
  expect_joins_under("Slurm", [](int r) {
    return std::map<std::string, std::string>{{"SLURM_PROCID", std::to_string(r)},
                                              {"SLURM_NTASKS", "2"},
                                              {"SLURM_LOCALID", std::to_string(r)},
                                              {"SLURM_TASKS_PER_NODE", "2"}};
  });
}

}  // namespace
