// Two nodes of two ranks each, each node a network namespace with its own address (see
// netns.h) and its own mdistrun --nnodes 2: the API, `mdist train`'s losses and the loss of a
// node, with no GLOO_SOCKET_IFNAME set (mdist picks the interface that routes to MASTER_ADDR).
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "tests/multinode/netns.h"
#include "tests/support/subprocess.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using mdist::testing::NetnsPair;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

constexpr int kPort = 29500;  // each pair of namespaces has its own port space

// Small enough for a 2-core machine (the settings of cli_test's quick runs).
const std::vector<std::string> kQuickTrain = {"--seq-len", "32", "--global-batch", "4",
                                              "--warmup",  "2",  "--log-every",    "1"};

std::string read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// A program running in the background, stdout and stderr into `log`; killed (with its process
// group) and reaped if still running when destroyed.
class Background {
 public:
  Background(std::vector<std::string> argv, const fs::path& log,
             const std::vector<std::string>& extra_env = {})
      : log_(log) {
    std::vector<std::string> env;
    for (char** entry = environ; *entry != nullptr; ++entry) {
      const std::string var = *entry;
      // This process's own launcher variables, and an interface choice that would hide what
      // is being tested, must not reach the job.
      bool drop = var.starts_with("GLOO_SOCKET_IFNAME=") || var.starts_with("OMP_NUM_THREADS=");
      for (const char* name :
           {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "LOCAL_WORLD_SIZE=", "MASTER_ADDR=",
            "MASTER_PORT=", "MDIST_STORE_LISTEN_FD=", "TORCHELASTIC_USE_AGENT_STORE="}) {
        drop = drop || var.starts_with(name);
      }
      if (!drop) env.push_back(var);
    }
    env.push_back("OMP_NUM_THREADS=1");  // the same arithmetic on every layout
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    std::vector<char*> cenv;
    for (auto& e : env) cenv.push_back(e.data());
    cenv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
      ::execve(cargv[0], cargv.data(), cenv.data());
      ::_exit(127);
    }
  }
  ~Background() {
    if (!code_) {
      ::kill(-pid_, SIGKILL);
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;

  // The exit code (128 + signal when killed), or empty if still running at `deadline`.
  std::optional<int> wait_until(Clock::time_point deadline) {
    while (!code_) {
      int status = 0;
      const pid_t done = ::waitpid(pid_, &status, WNOHANG);
      if (done == pid_) {
        code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        break;
      }
      if (Clock::now() >= deadline) break;
      std::this_thread::sleep_for(10ms);
    }
    return code_;
  }
  std::string output() const { return read(log_); }

 private:
  fs::path log_;
  pid_t pid_ = -1;
  std::optional<int> code_;
};

std::vector<double> losses(const fs::path& run) {
  std::vector<double> values;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    // A line still being written (the run is live) is not valid JSON yet: skipped.
    const auto json = nlohmann::json::parse(line, nullptr, false);
    if (json.is_object() && json.contains("loss")) values.push_back(json["loss"].get<double>());
  }
  return values;
}

class MultiNode : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    nodes_ = NetnsPair::create(why);
    if (!nodes_) GTEST_SKIP() << "multi-node tests need two network namespaces: " << why;
    dir_ = fs::temp_directory_path() /
           ("mdist-multinode-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure() && !dir_.empty()) fs::remove_all(dir_);
  }

  // mdistrun for node `node` of 2 (2 ranks), inside that node's namespace, running `program`.
  std::unique_ptr<Background> start_node(int node, const std::vector<std::string>& program,
                                         const std::vector<std::string>& extra_env = {}) {
    std::vector<std::string> argv = {MDIST_LAUNCHER,
                                     "--nnodes",
                                     "2",
                                     "--node-rank",
                                     std::to_string(node),
                                     "--nproc-per-node",
                                     "2",
                                     "--master-addr",
                                     master_addr_,
                                     "--master-port",
                                     std::to_string(kPort)};
    argv.insert(argv.end(), program.begin(), program.end());
    return std::make_unique<Background>(nodes_->inside(node, argv),
                                        dir_ / ("node" + std::to_string(node) + ".log"), extra_env);
  }

  // Starts both nodes and waits for both; their exit codes.
  std::vector<int> run_both(const std::vector<std::string>& program,
                            const std::vector<std::string>& extra_env = {},
                            std::chrono::seconds limit = 120s) {
    const auto deadline = Clock::now() + limit;
    std::vector<std::unique_ptr<Background>> nodes;
    for (int node = 0; node < 2; ++node) nodes.push_back(start_node(node, program, extra_env));
    std::vector<int> codes;
    for (auto& n : nodes) codes.push_back(n->wait_until(deadline).value_or(-1));
    logs_.clear();
    for (auto& n : nodes) logs_.push_back(n->output());
    return codes;
  }

  std::string describe() const {
    std::string text;
    for (std::size_t node = 0; node < logs_.size(); ++node) {
      text += "--- node " + std::to_string(node) + " ---\n" + logs_[node];
    }
    return text;
  }

  std::unique_ptr<NetnsPair> nodes_;
  std::string master_addr_ = NetnsPair::kAddress[0];  // --master-addr, node 0's
  fs::path dir_;
  std::vector<std::string> logs_;
};

// MASTER_ADDR as an IPv4 address, an IPv6 address and a host name (which, like this machine's
// own name, the Gloo default device would not have used).
class MultiNodeMasterAddr : public MultiNode, public ::testing::WithParamInterface<const char*> {};

TEST_P(MultiNodeMasterAddr, ApiWorksAcrossTwoNodesWithoutGlooSocketIfname) {
  master_addr_ = GetParam();
  const std::vector<int> codes = run_both({MDIST_MULTINODE_PROBE});
  ASSERT_EQ(codes, (std::vector<int>{0, 0})) << describe();
  for (int rank = 0; rank < 4; ++rank) {
    const std::string expected = "[rank" + std::to_string(rank) + "]: ok rank " +
                                 std::to_string(rank) + " of 4 local " + std::to_string(rank % 2) +
                                 " of 2 node " + std::to_string(rank / 2) + "\n";
    EXPECT_THAT(logs_[static_cast<std::size_t>(rank / 2)], HasSubstr(expected)) << describe();
  }
}

INSTANTIATE_TEST_SUITE_P(Addresses, MultiNodeMasterAddr,
                         ::testing::Values(NetnsPair::kAddress[0], NetnsPair::kAddress6[0],
                                           NetnsPair::kHostName[0]),
                         [](const auto& param_info) {
                           const std::string addr = param_info.param;
                           return addr == NetnsPair::kAddress[0]    ? std::string("IPv4")
                                  : addr == NetnsPair::kAddress6[0] ? std::string("IPv6")
                                                                    : std::string("HostName");
                         });

TEST_F(MultiNode, NodeZeroStoreListensOnMasterAddrOnly) {
  const std::vector<std::string> argv = {MDIST_LAUNCHER,
                                         "--nnodes",
                                         "2",
                                         "--node-rank",
                                         "0",
                                         "--master-addr",
                                         NetnsPair::kAddress[0],
                                         "--master-port",
                                         std::to_string(kPort),
                                         MDIST_LAUNCHER_PROBE,
                                         "print-env"};
  Background node0(nodes_->inside(0, argv), dir_ / "node0.log");
  ASSERT_EQ(node0.wait_until(Clock::now() + 60s), 0) << node0.output();
  EXPECT_THAT(node0.output(),
              HasSubstr("[rank0]: LISTEN_FD_ADDR=" + std::string(NetnsPair::kAddress[0]) + ":" +
                        std::to_string(kPort) + "\n"));
}

TEST_F(MultiNode, GlooConnectErrorNamesTheInterfaceAndGlooSocketIfname) {
  // Loopback cannot reach the other namespace: the full-mesh connect fails after the probe's
  // 5 s timeout, and the error says which interface was used and how to choose another.
  const std::vector<int> codes =
      run_both({MDIST_MULTINODE_PROBE, "5000"}, {"GLOO_SOCKET_IFNAME=lo"});
  EXPECT_NE(codes[0], 0) << describe();
  EXPECT_NE(codes[1], 0) << describe();
  EXPECT_THAT(logs_[0] + logs_[1],
              HasSubstr("Gloo used interface lo (GLOO_SOCKET_IFNAME); set GLOO_SOCKET_IFNAME to "
                        "the interface that reaches the other nodes"))
      << describe();
}

TEST_F(MultiNode, TrainOnTwoNodesGivesTheSingleNodeLosses) {
  constexpr int kSteps = 8;
  const auto train = [&](const fs::path& out) {
    std::vector<std::string> program = {MDIST_CLI, "train"};
    program.insert(program.end(), kQuickTrain.begin(), kQuickTrain.end());
    const std::vector<std::string> more = {
        "--steps", std::to_string(kSteps), "--save-every", "0", "--out", out.string()};
    program.insert(program.end(), more.begin(), more.end());
    return program;
  };
  std::vector<std::string> single = {MDIST_LAUNCHER, "--nproc-per-node", "4"};
  const auto single_program = train(dir_ / "single");
  single.insert(single.end(), single_program.begin(), single_program.end());
  Background one_node(single, dir_ / "single.log");
  ASSERT_EQ(one_node.wait_until(Clock::now() + 120s), 0) << one_node.output();

  const std::vector<int> codes = run_both(train(dir_ / "two-nodes"));
  ASSERT_EQ(codes, (std::vector<int>{0, 0})) << describe();
  const std::vector<double> expected = losses(dir_ / "single");
  const std::vector<double> got = losses(dir_ / "two-nodes");
  ASSERT_EQ(expected.size(), static_cast<std::size_t>(kSteps));
  ASSERT_EQ(got.size(), expected.size());
  double largest = 0;
  for (std::size_t step = 0; step < got.size(); ++step) {
    EXPECT_NEAR(got[step], expected[step], 1e-6) << "step " << step + 1;
    largest = std::max(largest, std::abs(got[step] - expected[step]));
  }
  std::cout << "largest loss difference over " << kSteps << " steps: " << largest << std::endl;
}

TEST_F(MultiNode, LosingANodeEndsTheOtherNodesJobWithinTenSeconds) {
  std::vector<std::string> program = {MDIST_CLI, "train"};
  program.insert(program.end(), kQuickTrain.begin(), kQuickTrain.end());
  const fs::path out = dir_ / "run";
  const std::vector<std::string> more = {"--steps", "100000", "--save-every",
                                         "0",       "--out",  out.string()};
  program.insert(program.end(), more.begin(), more.end());
  auto node0 = start_node(0, program);
  auto node1 = start_node(1, program);
  // Wait until training is under way on all four ranks (two steps logged).
  const auto started_by = Clock::now() + 120s;
  while (losses(out).size() < 2 && Clock::now() < started_by && !node0->wait_until(Clock::now()) &&
         !node1->wait_until(Clock::now())) {
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_GE(losses(out).size(), 2u) << node0->output() << node1->output();

  // Node 1 dies at once and entirely: its launcher and every rank, SIGKILLed.
  ASSERT_FALSE(nodes_->pids(1).empty());
  const auto killed = Clock::now();
  nodes_->kill_all(1);
  const std::optional<int> code = node0->wait_until(killed + 60s);
  const double seconds = std::chrono::duration<double>(Clock::now() - killed).count();
  std::cout << "node 0's mdistrun exited " << seconds << " s after node 1 was killed, code "
            << code.value_or(-1) << std::endl;
  ASSERT_TRUE(code.has_value()) << "node 0 still running 60 s after losing node 1\n"
                                << node0->output();
  EXPECT_NE(*code, 0) << node0->output();
  EXPECT_LT(seconds, 10.0) << node0->output();
  EXPECT_TRUE(nodes_->pids(0).empty()) << "ranks of node 0 outlived its mdistrun";
}

}  // namespace
