// Faults a user meets, each checked for its one-line message, exit code and bounded time.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <future>
#include <thread>

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

// Twelve jobs back to back in each of 4 processes on one port (mdist's own store, served by
// rank 0): no rank rendezvouses in the store of the job that just ended, so every job's
// allreduce is its own.
TEST(Lifecycle, JobsBackToBackInOneProcessEachMeetTheirOwnStore) {
  const auto result = run({kLauncher, "--nproc-per-node", "4", kProbe, "setup-many", "30000"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  for (int job = 0; job < 12; ++job) {
    for (int r = 0; r < 4; ++r) {
      // allreduce(rank + job) over 4 ranks: 6 + 4 * job.
      EXPECT_THAT(result.out, HasSubstr("[rank" + std::to_string(r) + "]: job " +
                                        std::to_string(job) + " rank " + std::to_string(r) +
                                        " sum " + std::to_string(6 + 4 * job) + "\n"));
    }
  }
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

// Whether something accepts connections on 127.0.0.1:port.
bool listening(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool connected = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return connected;
}

// Under torchrun's elastic agent the store is the agent's (TORCHELASTIC_USE_AGENT_STORE=True on
// its MASTER_ADDR:MASTER_PORT): rank 0 joins it as a client instead of failing to listen on the
// port, twice in one process too (a job generation keeps the second job's keys apart).
TEST(Rendezvous, TorchrunsAgentStoreIsJoinedNotServed) {
  const int port = mdist::testing::free_port();
  RunOptions agent_options = torchrun_env(0, 1, port);
  agent_options.timeout = std::chrono::seconds(90);
  auto agent = std::async(std::launch::async, [agent_options] {
    return run({kProbe, "serve-store", "30000"}, agent_options);
  });
  // Until the agent's store listens.
  for (int i = 0; i < 100 && !listening(port); ++i) {
    std::this_thread::sleep_for(100ms);
  }
  // The store is the agent's: without TORCHELASTIC_USE_AGENT_STORE rank 0 would try to serve
  // it, and says the port is taken.
  const auto own = run({kProbe, "setup", "1500"}, torchrun_env(0, 2, port));
  EXPECT_NE(own.exit_code, 0);
  EXPECT_THAT(own.err, HasSubstr("cannot listen on MASTER_PORT " + std::to_string(port)));
  for (const std::string mode : {"setup", "setup-twice"}) {
    std::vector<std::future<mdist::testing::RunResult>> ranks;
    for (int r = 0; r < 2; ++r) {
      RunOptions options = torchrun_env(r, 2, port);
      options.env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
      ranks.push_back(std::async(std::launch::async, [options, mode] {
        return run({kProbe, mode}, options);
      }));
    }
    for (int r = 0; r < 2; ++r) {
      const auto result = ranks[r].get();
      EXPECT_EQ(result.exit_code, 0) << mode << ": " << result.err;
      if (mode == "setup") {
        EXPECT_THAT(result.out, StartsWith("joined rank " + std::to_string(r) + " of 2 via "));
        EXPECT_THAT(result.out, EndsWith(" sum 1\n"));
      } else {
        EXPECT_EQ(result.out, "job 0 rank " + std::to_string(r) + " sum 1\njob 1 rank " +
                                  std::to_string(r) + " sum 3\n");
      }
    }
  }
  EXPECT_EQ(run({kProbe, "stop-store"}, torchrun_env(1, 2, port)).exit_code, 0);
  const auto served = agent.get();
  EXPECT_EQ(served.exit_code, 0) << served.err;
}

// The real torchrun (`torchrun --no-python`), when one is installed (MDIST_TORCHRUN, torchrun on
// PATH, or the bench virtual environment's): the same binary joins under its agent.
TEST(Launchers, RealTorchrun) {
  std::string torchrun;
  if (const char* given = std::getenv("MDIST_TORCHRUN")) torchrun = given;
  const std::string home = std::getenv("HOME") ? std::getenv("HOME") : "";
  for (const std::string& candidate :
       {std::string("/usr/local/bin/torchrun"), std::string("/usr/bin/torchrun"),
        home + "/.cache/mdist/bench-venv/bin/torchrun"}) {
    if (torchrun.empty() && ::access(candidate.c_str(), X_OK) == 0) torchrun = candidate;
  }
  if (torchrun.empty()) {
    GTEST_SKIP()
        << "no torchrun here (set MDIST_TORCHRUN, or make the bench venv: bench/bench_venv.sh)";
  }
  RunOptions options;
  options.timeout = std::chrono::seconds(120);
  const auto result = run({torchrun, "--no-python", "--nproc-per-node", "2", "--master-port",
                           std::to_string(mdist::testing::free_port()), kProbe, "setup"},
                          options);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_THAT(result.out, HasSubstr("joined rank 0 of 2 via torchrun sum 1"));
  EXPECT_THAT(result.out, HasSubstr("joined rank 1 of 2 via torchrun sum 1"));
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

// What srun exports to task r of `srun --ntasks 2` on one node (Slurm 23), beside the
// MASTER_ADDR / MASTER_PORT a batch script sets: the task variables and the step's layout.
std::map<std::string, std::string> srun_vars(int r) {
  return {{"SLURM_JOB_ID", "4242"},
          {"SLURM_JOBID", "4242"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_STEPID", "0"},
          {"SLURM_PROCID", std::to_string(r)},
          {"SLURM_LOCALID", std::to_string(r)},
          {"SLURM_GTIDS", "0,1"},
          {"SLURM_NODEID", "0"},
          {"SLURM_NTASKS", "2"},
          {"SLURM_NPROCS", "2"},
          {"SLURM_NNODES", "1"},
          {"SLURM_JOB_NUM_NODES", "1"},
          {"SLURM_STEP_NUM_TASKS", "2"},
          {"SLURM_STEP_NUM_NODES", "1"},
          {"SLURM_TASKS_PER_NODE", "2"},
          {"SLURM_STEP_TASKS_PER_NODE", "2"},
          {"SLURM_NODELIST", "node[07]"},
          {"SLURM_JOB_NODELIST", "node[07]"},
          {"SLURM_STEP_NODELIST", "node[07]"},
          {"SLURMD_NODENAME", "node07"},
          {"SLURM_CPUS_ON_NODE", "2"},
          {"SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"},
          {"SLURM_SRUN_COMM_HOST", "127.0.0.1"},
          {"SLURM_TOPOLOGY_ADDR", "node07"},
          {"SLURM_CPU_BIND", "quiet,mask_cpu:0x1"}};
}

TEST(Launchers, Slurm) { expect_joins_under("Slurm", srun_vars); }

// torchrun started inside a Slurm allocation (the batch step: task 0 of 1 on each node) sets
// its own variables for each rank: those win over the batch step's SLURM_PROCID / NTASKS.
TEST(Launchers, TorchrunInsideASlurmAllocation) {
  expect_joins_under("torchrun", [](int r) {
    auto vars = srun_vars(0);
    vars["SLURM_NTASKS"] = vars["SLURM_NPROCS"] = vars["SLURM_TASKS_PER_NODE"] = "1";
    vars["SLURM_GTIDS"] = "0";
    vars["RANK"] = vars["LOCAL_RANK"] = std::to_string(r);
    vars["WORLD_SIZE"] = vars["LOCAL_WORLD_SIZE"] = "2";
    return vars;
  });
}

}  // namespace
