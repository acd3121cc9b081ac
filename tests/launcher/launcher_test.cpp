// End-to-end tests of mdistrun: run the real binary on launcher_probe and check what a user
// would see (env contract, output, exit codes, signals, cleanup, error messages).
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;  // NOLINT: POSIX global

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

const std::string kMdistrun = MDISTRUN_PATH;
const std::string kProbe = LAUNCHER_PROBE_PATH;
// Upper bound for any single launcher run in these tests: a hang fails instead of blocking.
constexpr auto kRunTimeout = 20s;
constexpr int kLeakedFd = 77;

struct RunResult {
  int exit_code = -1;  // 128 + N if mdistrun itself died by signal N
  bool exited_normally = false;
  std::string out;
  std::string err;
  double seconds = 0;
};

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Environment for mdistrun: ours, minus variables that would change what is being tested.
std::vector<std::string> test_environment(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string var = *entry;
    if (var.starts_with("OMP_NUM_THREADS=") || var.starts_with("MDIST_STORE_LISTEN_FD=")) continue;
    env.push_back(var);
  }
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

// mdistrun running as our child, its stdout and stderr captured through pipes.
class Launcher {
 public:
  // `ignored_signals` start out ignored in mdistrun, as `nohup` would leave SIGHUP.
  explicit Launcher(const std::vector<std::string>& args,
                    const std::vector<std::string>& env = test_environment(),
                    const std::vector<int>& ignored_signals = {})
      : start_(Clock::now()) {
    std::vector<std::string> argv_strings = {kMdistrun};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_strings = env;
    std::vector<char*> envp;
    for (std::string& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);

    int out[2];
    int err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) std::abort();
    pid_ = ::fork();
    if (pid_ == 0) {
      // Whatever the test runner left ignored or blocked must not change what is tested.
      for (const int signo : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGCHLD}) {
        const bool ignore = std::find(ignored_signals.begin(), ignored_signals.end(), signo) !=
                            ignored_signals.end();
        ::signal(signo, ignore ? SIG_IGN : SIG_DFL);
      }
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      // An fd leaked to mdistrun without CLOEXEC, which must not reach the ranks.
      ::dup2(::open("/dev/null", O_RDONLY | O_CLOEXEC), kLeakedFd);
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(126);
    }
    ::close(out[1]);
    ::close(err[1]);
    out_fd_ = out[0];
    err_fd_ = err[0];
  }
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;
  ~Launcher() {
    if (!finished_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (out_fd_ >= 0) ::close(out_fd_);
    if (err_fd_ >= 0) ::close(err_fd_);
  }

  [[nodiscard]] pid_t pid() const { return pid_; }

  // Collects all output until mdistrun exits (SIGKILLs it after kRunTimeout).
  RunResult wait() {
    RunResult result;
    const auto deadline = start_ + kRunTimeout;
    bool timed_out = false;
    while (out_fd_ >= 0 || err_fd_ >= 0) {
      pollfd fds[2] = {{out_fd_, POLLIN, 0}, {err_fd_, POLLIN, 0}};
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left <= 0ms) {
        timed_out = true;
        ::kill(pid_, SIGKILL);
        break;
      }
      ::poll(fds, 2, static_cast<int>(left.count()));
      read_into(fds[0], out_fd_, result.out);
      read_into(fds[1], err_fd_, result.err);
    }
    int status = 0;
    ::waitpid(pid_, &status, 0);
    finished_ = true;
    result.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    result.exited_normally = WIFEXITED(status);
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    EXPECT_FALSE(timed_out) << "mdistrun did not finish within the test timeout";
    return result;
  }

 private:
  static void read_into(const pollfd& pfd, int& fd, std::string& sink) {
    if (fd < 0 || pfd.revents == 0) return;
    char buffer[65536];
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n > 0) {
      sink.append(buffer, static_cast<std::size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      ::close(fd);
      fd = -1;
    }
  }

  Clock::time_point start_;
  pid_t pid_ = -1;
  int out_fd_ = -1;
  int err_fd_ = -1;
  bool finished_ = false;
};

RunResult run(const std::vector<std::string>& args,
              const std::vector<std::string>& env = test_environment()) {
  return Launcher(args, env).wait();
}

// "[rank<R>]: KEY=VALUE" lines -> per-rank map.
std::map<int, std::map<std::string, std::string>> parse_rank_vars(const std::string& out) {
  static const std::regex line_re(R"(^\[rank(\d+)\]: ([A-Z_]+)=(.*)$)");
  std::map<int, std::map<std::string, std::string>> vars;
  for (const std::string& line : lines_of(out)) {
    std::smatch m;
    if (std::regex_match(line, m, line_re)) vars[std::stoi(m[1])][m[2]] = m[3];
  }
  return vars;
}

int count_occurrences(const std::string& text, const std::string& needle) {
  int count = 0;
  for (std::size_t pos = text.find(needle); pos != std::string::npos;
       pos = text.find(needle, pos + 1)) {
    ++count;
  }
  return count;
}

// A fresh directory for the files the probe writes, removed afterwards.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "mdistrun-test-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) std::abort();
    path_ = pattern;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  [[nodiscard]] std::string prefix() const { return (path_ / "probe").string(); }
  [[nodiscard]] std::string file(int rank, const std::string& suffix) const {
    return prefix() + "." + std::to_string(rank) + "." + suffix;
  }

 private:
  fs::path path_;
};

bool wait_for_file(const std::string& path, std::chrono::milliseconds timeout = 10s) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (fs::exists(path)) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

std::vector<pid_t> read_pids(const std::string& path) {
  std::ifstream in(path);
  std::vector<pid_t> pids;
  for (pid_t pid = 0; in >> pid;) pids.push_back(pid);
  return pids;
}

bool process_gone(pid_t pid) { return ::kill(pid, 0) != 0 && errno == ESRCH; }

// A TCP socket we hold, bound and listening on 127.0.0.1 at a kernel-chosen port.
struct HeldPort {
  int fd = -1;
  int port = 0;
  HeldPort() {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(sa);
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
        ::listen(fd, 1) != 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
      std::abort();
    }
    port = ntohs(sa.sin_port);
  }
  HeldPort(const HeldPort&) = delete;
  HeldPort& operator=(const HeldPort&) = delete;
  ~HeldPort() { ::close(fd); }
};

// ---------------------------------------------------------------------------------------------
// Environment contract

class EnvContractTest : public ::testing::TestWithParam<int> {};

TEST_P(EnvContractTest, EveryRankGetsTheTorchrunEnvironment) {
  const int nproc = GetParam();
  const RunResult r = run({"--nproc-per-node", std::to_string(nproc), kProbe, "print-env"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto vars = parse_rank_vars(r.out);
  ASSERT_EQ(vars.size(), static_cast<std::size_t>(nproc)) << r.out;

  const std::string port = vars.at(0).at("MASTER_PORT");
  ASSERT_GT(std::stoi(port), 0);
  const std::string run_id = vars.at(0).at("TORCHELASTIC_RUN_ID");
  EXPECT_NE(run_id, "<unset>");
  for (int rank = 0; rank < nproc; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const auto& v = vars.at(rank);
    const std::string n = std::to_string(nproc);
    EXPECT_EQ(v.at("RANK"), std::to_string(rank));
    EXPECT_EQ(v.at("LOCAL_RANK"), std::to_string(rank));
    EXPECT_EQ(v.at("WORLD_SIZE"), n);
    EXPECT_EQ(v.at("LOCAL_WORLD_SIZE"), n);
    EXPECT_EQ(v.at("GROUP_RANK"), "0");
    EXPECT_EQ(v.at("GROUP_WORLD_SIZE"), "1");
    EXPECT_EQ(v.at("ROLE_RANK"), std::to_string(rank));
    EXPECT_EQ(v.at("ROLE_WORLD_SIZE"), n);
    EXPECT_EQ(v.at("ROLE_NAME"), "default");
    EXPECT_EQ(v.at("MASTER_ADDR"), "127.0.0.1");
    EXPECT_EQ(v.at("MASTER_PORT"), port);  // one shared port
    EXPECT_EQ(v.at("TORCHELASTIC_RESTART_COUNT"), "0");
    EXPECT_EQ(v.at("TORCHELASTIC_MAX_RESTARTS"), "0");
    EXPECT_EQ(v.at("TORCHELASTIC_RUN_ID"), run_id);
    EXPECT_EQ(v.at("OMP_NUM_THREADS"), nproc > 1 ? "1" : "<unset>");
    EXPECT_EQ(v.at("OWN_PROCESS_GROUP"), "1");
    EXPECT_EQ(v.at("SIGNALS_UNBLOCKED"), "1");
    EXPECT_EQ(v.at("SIGPIPE_DEFAULT"), "1");
    EXPECT_EQ(v.at("STRAY_FDS"), "");
    if (rank == 0) {
      EXPECT_NE(v.at("MDIST_STORE_LISTEN_FD"), "<unset>");
      EXPECT_EQ(v.at("LISTEN_FD_IS_SOCKET"), "1");
      EXPECT_EQ(v.at("LISTEN_FD_LISTENING"), "1");
      EXPECT_EQ(v.at("LISTEN_FD_ADDR"), "127.0.0.1:" + port);
      EXPECT_EQ(v.at("MASTER_PORT_LISTENERS"), "1");
    } else {
      // Neither the variable nor the socket itself reaches other ranks.
      EXPECT_EQ(v.at("MDIST_STORE_LISTEN_FD"), "<unset>");
      EXPECT_EQ(v.at("MASTER_PORT_LISTENERS"), "0");
    }
  }
  EXPECT_EQ(count_occurrences(r.err, "OMP_NUM_THREADS"), nproc > 1 ? 1 : 0) << r.err;
}

INSTANTIATE_TEST_SUITE_P(Ranks, EnvContractTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& param_info) {
                           return "nproc" + std::to_string(param_info.param);
                         });

TEST(LauncherTest, KeepsAnExistingOmpNumThreads) {
  const RunResult r =
      run({"--nproc-per-node", "2", kProbe, "print-env"}, test_environment({"OMP_NUM_THREADS=7"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto vars = parse_rank_vars(r.out);
  EXPECT_EQ(vars.at(0).at("OMP_NUM_THREADS"), "7");
  EXPECT_EQ(vars.at(1).at("OMP_NUM_THREADS"), "7");
  EXPECT_EQ(r.err, "");
}

TEST(LauncherTest, WarnsWhenTheRanksExceedTheCores) {
  const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
  ASSERT_GT(cores, 0);
  const std::string ranks = std::to_string(cores + 1);
  const RunResult r = run({"--nproc-per-node", ranks, kProbe, "print-env"},
                          test_environment({"OMP_NUM_THREADS=1"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("mdistrun: warning: --nproc-per-node " + ranks + " exceeds this node's " +
                       std::to_string(cores) + " CPU cores"),
            std::string::npos)
      << r.err;
}

TEST(LauncherTest, StaleListenFdVariableIsNotInherited) {
  const RunResult r = run({"--nproc-per-node", "2", kProbe, "print-env"},
                          test_environment({"MDIST_STORE_LISTEN_FD=1"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(parse_rank_vars(r.out).at(1).at("MDIST_STORE_LISTEN_FD"), "<unset>");
}

TEST(LauncherTest, AcceptsUnderscoreSpellingsAndTorchrunNoOps) {
  const RunResult r = run({"--standalone", "--nproc_per_node", "2", "--master_addr", "127.0.0.2",
                           "--no-python", "--no_python", kProbe, "print-env"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto vars = parse_rank_vars(r.out);
  ASSERT_EQ(vars.size(), 2u);
  // Another loopback address is honoured, and the store binds exactly that address.
  EXPECT_EQ(vars.at(1).at("MASTER_ADDR"), "127.0.0.2");
  EXPECT_EQ(vars.at(0).at("LISTEN_FD_ADDR"), "127.0.0.2:" + vars.at(0).at("MASTER_PORT"));
}

TEST(LauncherTest, SingleNodeIgnoresANonLoopbackMasterAddr) {
  const RunResult r = run({"--master-addr", "10.11.12.13", kProbe, "print-env"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto vars = parse_rank_vars(r.out);
  EXPECT_EQ(vars.at(0).at("MASTER_ADDR"), "127.0.0.1");
  EXPECT_TRUE(vars.at(0).at("LISTEN_FD_ADDR").starts_with("127.0.0.1:"));
  EXPECT_NE(r.err.find("mdistrun: single-node job: ignoring --master-addr 10.11.12.13"),
            std::string::npos)
      << r.err;
}

TEST(LauncherTest, UsesTheGivenMasterPort) {
  int port = 0;
  {
    const HeldPort probe_port;  // find a free port, then release it for mdistrun
    port = probe_port.port;
  }
  const RunResult r = run({"--master-port", std::to_string(port), kProbe, "print-env"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto vars = parse_rank_vars(r.out);
  EXPECT_EQ(vars.at(0).at("MASTER_PORT"), std::to_string(port));
  EXPECT_EQ(vars.at(0).at("LISTEN_FD_ADDR"), "127.0.0.1:" + std::to_string(port));
}

TEST(LauncherTest, MultiNodeOtherNodeBindsNothing) {
  // We hold the port ourselves: a node rank > 0 must not try to bind it.
  const HeldPort held;
  const RunResult r =
      run({"--nnodes", "2", "--node_rank", "1", "--nproc-per-node", "2", "--master-addr",
           "10.1.2.3", "--master-port", std::to_string(held.port), kProbe, "print-env"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto vars = parse_rank_vars(r.out);
  ASSERT_EQ(vars.size(), 2u) << r.out;
  for (int rank : {2, 3}) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const auto& v = vars.at(rank);
    EXPECT_EQ(v.at("RANK"), std::to_string(rank));
    EXPECT_EQ(v.at("LOCAL_RANK"), std::to_string(rank - 2));
    EXPECT_EQ(v.at("WORLD_SIZE"), "4");
    EXPECT_EQ(v.at("LOCAL_WORLD_SIZE"), "2");
    EXPECT_EQ(v.at("GROUP_RANK"), "1");
    EXPECT_EQ(v.at("GROUP_WORLD_SIZE"), "2");
    EXPECT_EQ(v.at("MASTER_ADDR"), "10.1.2.3");
    EXPECT_EQ(v.at("MASTER_PORT"), std::to_string(held.port));
    EXPECT_EQ(v.at("MDIST_STORE_LISTEN_FD"), "<unset>");
  }
}

TEST(LauncherTest, MultiNodeNodeZeroListensOnAllInterfacesWhenMasterAddrIsNotLocal) {
  // 10.1.2.3 is not this host's (as a NAT or load-balancer address would not be): the store
  // listens everywhere, as torchrun's does, and says so once.
  int port = 0;
  {
    const HeldPort probe_port;
    port = probe_port.port;
  }
  const RunResult r = run({"--nnodes", "2", "--node-rank", "0", "--master-addr", "10.1.2.3",
                           "--master-port", std::to_string(port), kProbe, "print-env"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err,
            "mdistrun: --master-addr 10.1.2.3 is not an address of this host; the store listens "
            "on all interfaces\n");
  const auto vars = parse_rank_vars(r.out);
  const auto& v = vars.at(0);
  EXPECT_EQ(v.at("WORLD_SIZE"), "2");
  EXPECT_EQ(v.at("MASTER_ADDR"), "10.1.2.3");
  EXPECT_EQ(v.at("LISTEN_FD_LISTENING"), "1");
  EXPECT_EQ(v.at("LISTEN_FD_ADDR"), "0.0.0.0:" + std::to_string(port));
}

TEST(LauncherTest, MultiNodeNodeZeroListensOnMasterAddrWhenItIsLocal) {
  // Every 127.x address is this host's; tests/multinode does the same with a veth address.
  int port = 0;
  {
    const HeldPort probe_port;
    port = probe_port.port;
  }
  const RunResult r = run({"--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.2",
                           "--master-port", std::to_string(port), kProbe, "print-env"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  const auto vars = parse_rank_vars(r.out);
  EXPECT_EQ(vars.at(0).at("MASTER_ADDR"), "127.0.0.2");
  EXPECT_EQ(vars.at(0).at("LISTEN_FD_ADDR"), "127.0.0.2:" + std::to_string(port));
}

TEST(LauncherTest, MaxRestartsOnSeveralNodesIsRefusedWithExitCodeTwo) {
  const RunResult r = run({"--nnodes", "2", "--node-rank", "0", "--master-port", "29500",
                           "--max-restarts", "1", kProbe, "print-env"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err,
            "mdistrun: --max-restarts needs a single node (--nnodes 1): restarting several nodes "
            "together needs an agent rendezvous mdistrun does not have (see 'mdistrun --help')\n");
}

TEST(LauncherTest, ArgumentsAfterProgramBelongToTheProgram) {
  const RunResult r = run({kProbe, "echo-args", "--nproc-per-node", "5", "-h", "--", "x y"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out,
            "[rank0]: ARG=--nproc-per-node\n[rank0]: ARG=5\n[rank0]: ARG=-h\n"
            "[rank0]: ARG=--\n[rank0]: ARG=x y\n");
}

TEST(LauncherTest, DoubleDashEndsLauncherOptions) {
  const RunResult r = run({"--nproc-per-node", "1", "--", kProbe, "echo-args", "a"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "[rank0]: ARG=a\n");
}

TEST(LauncherTest, HelpPrintsUsage) {
  const RunResult r = run({"--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("Usage: mdistrun [OPTIONS] PROGRAM [ARGS...]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--nproc-per-node"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Output forwarding

TEST(LauncherTest, PrefixesLinesAndKeepsStreamsAndOrder) {
  constexpr int kLines = 300;
  const RunResult r = run({"--nproc-per-node", "3", kProbe, "lines", std::to_string(kLines)});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::regex line_re(R"(^\[rank(\d)\]: (out|err) (\d+)$)");
  for (const auto& [text, stream] : {std::pair{&r.out, "out"}, std::pair{&r.err, "err"}}) {
    std::map<int, int> next;  // per rank: the line number expected next
    for (const std::string& line : lines_of(*text)) {
      if (line.starts_with("mdistrun: ")) continue;  // the OMP_NUM_THREADS note
      std::smatch m;
      ASSERT_TRUE(std::regex_match(line, m, line_re)) << "unexpected line: " << line;
      EXPECT_EQ(m[2].str(), stream) << line;
      const int rank = std::stoi(m[1]);
      EXPECT_EQ(std::stoi(m[3]), next[rank]++) << "out of order: " << line;
    }
    EXPECT_EQ(next, (std::map<int, int>{{0, kLines}, {1, kLines}, {2, kLines}})) << stream;
  }
}

TEST(LauncherTest, FlushesAPartialLastLineWithANewline) {
  const RunResult r = run({kProbe, "partial-line"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "[rank0]: complete line\n[rank0]: no newline at the end\n");
  EXPECT_EQ(r.err, "[rank0]: stderr without newline\n");
}

// ---------------------------------------------------------------------------------------------
// Exit policy

TEST(LauncherTest, FailingRankEndsTheJobWithItsCode) {
  const RunResult r = run({"--nproc-per-node", "3", kProbe, "exit-on-rank", "1", "3"});
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_TRUE(r.exited_normally);
  // The other ranks sleep for a minute: only the launcher's SIGTERM ends them this quickly.
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_TRUE(std::regex_search(
      r.err, std::regex(R"((^|\n)mdistrun: rank 1 \(pid \d+\) exited with code 3\n)")))
      << r.err;
  EXPECT_EQ(count_occurrences(r.err, "exited with code"), 1) << r.err;
  EXPECT_EQ(r.out, "[rank1]: rank 1 exiting with 3\n");
}

// torchrun's --max-restarts: a failure stops every rank and starts them all again with
// TORCHELASTIC_RESTART_COUNT counting; after N restarts the job ends with the failure's code.
TEST(LauncherTest, MaxRestartsStartsEveryRankAgainUntilItSucceedsOrGivesUp) {
  RunResult r =
      run({"--nproc-per-node", "2", "--max-restarts", "2", kProbe, "fail-until-restart", "2"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("[rank0]: rank 0 attempt 2\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank1]: rank 1 attempt 2\n"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("mdistrun: restarting every rank (restart 1 of 2, "
                       "TORCHELASTIC_RESTART_COUNT=1)"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("(restart 2 of 2, TORCHELASTIC_RESTART_COUNT=2)"), std::string::npos);
  EXPECT_EQ(count_occurrences(r.err, "exited with code 3"), 2) << r.err;

  r = run({"--nproc-per-node", "2", "--max-restarts", "1", kProbe, "fail-until-restart", "2"});
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("mdistrun: giving up after 1 restart(s)"), std::string::npos) << r.err;
  EXPECT_EQ(r.out, "");
}

TEST(LauncherTest, SegfaultingRankGives139) {
  const RunResult r = run({"--nproc-per-node", "2", kProbe, "segv-on-rank", "0"});
  EXPECT_EQ(r.exit_code, 139) << r.err;
  EXPECT_TRUE(r.exited_normally);
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_TRUE(std::regex_search(
      r.err, std::regex(R"(mdistrun: rank 0 \(pid \d+\) was killed by signal 11 \(SIGSEGV\)\n)")))
      << r.err;
}

TEST(LauncherTest, RankIgnoringSigtermIsKilledAfterTheGracePeriod) {
  const TempDir dir;
  const RunResult r = run({"--nproc-per-node", "3", "--kill-timeout", "1", kProbe,
                           "stubborn-others", dir.prefix(), "2", "4"});
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_GE(r.seconds, 1.0);  // SIGTERM was ignored: only SIGKILL after 1 s ends ranks 0 and 1
  EXPECT_LT(r.seconds, 10.0);
}

TEST(LauncherTest, AllRanksSucceedingExitsZero) {
  const RunResult r = run({"--nproc-per-node", "4", kProbe, "echo-args"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(count_occurrences(r.err, "exited"), 0) << r.err;
}

// ---------------------------------------------------------------------------------------------
// Signals and cleanup

class ForwardedSignalTest : public ::testing::TestWithParam<std::pair<int, std::string>> {};

TEST_P(ForwardedSignalTest, ReachesEveryRankAndSetsTheExitCode) {
  const auto& [signo, suffix] = GetParam();
  constexpr int kRanks = 3;
  const TempDir dir;
  Launcher launcher({"--nproc-per-node", std::to_string(kRanks), kProbe, "sleep-and-record-signal",
                     dir.prefix()});
  for (int rank = 0; rank < kRanks; ++rank) {
    ASSERT_TRUE(wait_for_file(dir.file(rank, "pid"))) << "rank " << rank << " never started";
  }
  ASSERT_EQ(::kill(launcher.pid(), signo), 0);
  const RunResult r = launcher.wait();
  EXPECT_EQ(r.exit_code, 128 + signo) << r.err;
  EXPECT_TRUE(r.exited_normally);
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_TRUE(fs::exists(dir.file(rank, suffix))) << "rank " << rank << " got no " << suffix;
    for (const pid_t pid : read_pids(dir.file(rank, "pid"))) EXPECT_TRUE(process_gone(pid));
  }
}

INSTANTIATE_TEST_SUITE_P(Signals, ForwardedSignalTest,
                         ::testing::Values(std::pair{SIGTERM, std::string("term")},
                                           std::pair{SIGINT, std::string("int")},
                                           std::pair{SIGHUP, std::string("hup")}),
                         [](const auto& param_info) { return param_info.param.second; });

TEST(LauncherTest, SecondSignalSkipsTheGracePeriod) {
  constexpr int kRanks = 2;
  const TempDir dir;
  // No rank is exempt (rank -1): every rank ignores SIGTERM, and the grace period is long.
  Launcher launcher({"--nproc-per-node", std::to_string(kRanks), "--kill-timeout", "60", kProbe,
                     "stubborn-others", dir.prefix(), "-1", "0"});
  for (int rank = 0; rank < kRanks; ++rank) ASSERT_TRUE(wait_for_file(dir.file(rank, "ready")));
  ASSERT_EQ(::kill(launcher.pid(), SIGTERM), 0);
  std::this_thread::sleep_for(200ms);
  ASSERT_EQ(::waitpid(launcher.pid(), nullptr, WNOHANG), 0) << "gave up before the grace period";
  ASSERT_EQ(::kill(launcher.pid(), SIGTERM), 0);
  const RunResult r = launcher.wait();
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.err;
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_NE(r.err.find("killing every rank"), std::string::npos) << r.err;
}

TEST(LauncherTest, SighupIgnoredAtStartupStaysIgnored) {
  const TempDir dir;
  // Like `nohup mdistrun ...`: a hangup must neither stop the job nor reach the ranks.
  Launcher launcher({kProbe, "sleep-and-record-signal", dir.prefix()}, test_environment(),
                    {SIGHUP});
  ASSERT_TRUE(wait_for_file(dir.file(0, "pid")));
  ASSERT_EQ(::kill(launcher.pid(), SIGHUP), 0);
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(fs::exists(dir.file(0, "hup")));
  ASSERT_EQ(::kill(launcher.pid(), SIGTERM), 0);
  const RunResult r = launcher.wait();
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.err;
  EXPECT_TRUE(fs::exists(dir.file(0, "term")));
}

TEST(LauncherTest, NoGrandchildSurvivesTheLauncher) {
  constexpr int kRanks = 2;
  const TempDir dir;
  const RunResult r =
      run({"--nproc-per-node", std::to_string(kRanks), kProbe, "spawn-grandchild", dir.prefix()});
  EXPECT_EQ(r.exit_code, 5) << r.err;
  EXPECT_LT(r.seconds, 10.0);
  for (int rank = 0; rank < kRanks; ++rank) {
    const std::vector<pid_t> pids = read_pids(dir.file(rank, "grandchildren"));
    ASSERT_EQ(pids.size(), 2u) << "rank " << rank;
    // One sleeper stayed in the rank's process group, the other escaped it with setsid().
    for (const pid_t pid : pids) EXPECT_TRUE(process_gone(pid)) << "pid " << pid << " survived";
  }
}

TEST(LauncherTest, RanksDieWhenTheLauncherIsKilled) {
  constexpr int kRanks = 2;
  const TempDir dir;
  // Orphaned ranks get re-parented to us, so we can reap them and see them go.
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  std::vector<pid_t> ranks;
  {
    Launcher launcher({"--nproc-per-node", std::to_string(kRanks), kProbe,
                       "sleep-and-record-signal", dir.prefix()});
    for (int rank = 0; rank < kRanks; ++rank) {
      ASSERT_TRUE(wait_for_file(dir.file(rank, "pid")));
      ranks.push_back(read_pids(dir.file(rank, "pid")).at(0));
    }
    ASSERT_EQ(::kill(launcher.pid(), SIGKILL), 0);
    EXPECT_EQ(launcher.wait().exit_code, 128 + SIGKILL);
  }
  const auto deadline = Clock::now() + 5s;
  for (const pid_t pid : ranks) {
    // PR_SET_PDEATHSIG: SIGKILL, so no .term file, and the rank goes away promptly.
    while (!process_gone(pid) && Clock::now() < deadline) {
      ::waitpid(pid, nullptr, WNOHANG);
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_TRUE(process_gone(pid)) << "rank pid " << pid << " outlived the launcher";
  }
  ::prctl(PR_SET_CHILD_SUBREAPER, 0);
}

// ---------------------------------------------------------------------------------------------
// Errors before any rank starts

TEST(LauncherTest, PortInUseIsOneLineAndStartsNoRank) {
  const HeldPort held;
  const TempDir dir;
  const RunResult r = run({"--nproc-per-node", "2", "--master-port", std::to_string(held.port),
                           kProbe, "sleep-and-record-signal", dir.prefix()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "mdistrun: cannot listen on 127.0.0.1:" + std::to_string(held.port) +
                       " (--master-port): Address already in use\n");
  EXPECT_EQ(r.out, "");
  EXPECT_FALSE(fs::exists(dir.file(0, "pid")));
  EXPECT_FALSE(fs::exists(dir.file(1, "pid")));
}

TEST(LauncherTest, UnexecutableProgramIsReportedOnce) {
  const RunResult r = run({"--nproc-per-node", "3", "/nonexistent/program", "arg"});
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_EQ(r.err, "mdistrun: cannot execute '/nonexistent/program': No such file or directory\n");
  EXPECT_EQ(r.out, "");
}

TEST(LauncherTest, UnexecutableProgramInPathIsReportedOnce) {
  const RunResult r =
      run({"mdistrun-test-no-such-program"}, test_environment({"PATH=/nonexistent"}));
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_EQ(
      r.err,
      "mdistrun: cannot execute 'mdistrun-test-no-such-program': No such file or directory\n");
}

struct BadInput {
  std::string name;
  std::vector<std::string> args;
  std::string message;  // expected to appear in the single stderr line
};

// Names the parameter in test output instead of dumping its bytes.
void PrintTo(const BadInput& input, std::ostream* os) { *os << input.name; }

class BadInputTest : public ::testing::TestWithParam<BadInput> {};

TEST_P(BadInputTest, FailsWithOneClearLine) {
  const BadInput& input = GetParam();
  const RunResult r = run(input.args);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(r.exited_normally);
  EXPECT_EQ(r.out, "");
  const std::vector<std::string> lines = lines_of(r.err);
  ASSERT_EQ(lines.size(), 1u) << r.err;
  EXPECT_TRUE(lines[0].starts_with("mdistrun: ")) << lines[0];
  EXPECT_NE(lines[0].find(input.message), std::string::npos) << lines[0];
}

INSTANTIATE_TEST_SUITE_P(
    Inputs, BadInputTest,
    ::testing::Values(
        BadInput{"MissingProgram", {"--nproc-per-node", "2"}, "missing PROGRAM"},
        BadInput{"NoArguments", {}, "missing PROGRAM"},
        BadInput{"NegativeMaxRestarts", {"--max-restarts=-1", "true"}, "--max-restarts must be"},
        BadInput{"MaxRestartsOnSeveralNodes",
                 {"--max-restarts", "1", "--nnodes", "2", "--master-port", "29500", "true"},
                 "--max-restarts needs a single node (--nnodes 1)"},
        BadInput{"ZeroNproc", {"--nproc-per-node", "0", "true"}, "--nproc-per-node must be"},
        BadInput{"NegativeNproc", {"--nproc-per-node=-2", "true"}, "--nproc-per-node must be"},
        BadInput{"NonNumericNproc", {"--nproc_per_node", "four", "true"}, "got 'four'"},
        BadInput{"ZeroNnodes", {"--nnodes", "0", "true"}, "--nnodes must be"},
        BadInput{"NodeRankTooLarge",
                 {"--nnodes", "2", "--node-rank", "2", "--master-port", "29500", "true"},
                 "--node-rank must be in [0, 2)"},
        BadInput{"NegativeNodeRank", {"--node-rank", "-1", "true"}, "--node-rank must be"},
        BadInput{"PortTooLarge", {"--master-port", "65536", "true"}, "--master-port must be"},
        BadInput{"NegativePort", {"--master-port", "-1", "true"}, "--master-port must be"},
        BadInput{"NonNumericPort", {"--master-port", "http", "true"}, "got 'http'"},
        BadInput{"MultiNodeWithoutPort", {"--nnodes", "2", "true"}, "--master-port"},
        BadInput{"BadKillTimeout", {"--kill-timeout", "soon", "true"}, "--kill-timeout must be"},
        BadInput{"UnknownOption", {"--nproc-per-nod", "2", "true"}, "unknown option"},
        BadInput{"MissingValue", {"--nproc-per-node"}, "--nproc-per-node"}),
    [](const auto& param_info) { return param_info.param.name; });

}  // namespace
