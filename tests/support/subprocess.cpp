#include "tests/support/subprocess.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

extern char** environ;

namespace mdist::testing {
namespace {

const char* const kLaunchVars[] = {"RANK",
                                   "WORLD_SIZE",
                                   "LOCAL_RANK",
                                   "LOCAL_WORLD_SIZE",
                                   "MASTER_ADDR",
                                   "MASTER_PORT",
                                   "MDIST_STORE_LISTEN_FD",
                                   "OMPI_COMM_WORLD_RANK",
                                   "OMPI_COMM_WORLD_SIZE",
                                   "OMPI_COMM_WORLD_LOCAL_RANK",
                                   "OMPI_COMM_WORLD_LOCAL_SIZE",
                                   "PMI_RANK",
                                   "PMI_SIZE",
                                   "SLURM_PROCID",
                                   "SLURM_NTASKS",
                                   "SLURM_LOCALID",
                                   "SLURM_NODEID",
                                   "SLURM_TASKS_PER_NODE"};

int bind_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(fd, 16) != 0) {
    throw std::runtime_error(std::string("test: cannot bind a loopback port: ") +
                             std::strerror(errno));
  }
  return fd;
}

int port_of(int fd) {
  sockaddr_in addr{};
  socklen_t length = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length);
  return ntohs(addr.sin_port);
}

}  // namespace

RunResult run(const std::vector<std::string>& argv, const RunOptions& options) {
  std::array<int, 2> out_pipe{};
  std::array<int, 2> err_pipe{};
  if (::pipe2(out_pipe.data(), O_CLOEXEC) != 0 || ::pipe2(err_pipe.data(), O_CLOEXEC) != 0) {
    throw std::runtime_error("test: pipe failed");
  }
  if (options.stdout_terminal) {
    // The pseudo-terminal's primary side replaces the stdout pipe's read end; the child opens
    // the secondary side as its stdout.
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    out_pipe[0] = ::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (out_pipe[0] < 0 || ::grantpt(out_pipe[0]) != 0 || ::unlockpt(out_pipe[0]) != 0) {
      throw std::runtime_error("test: posix_openpt failed");
    }
    out_pipe[1] = ::open(::ptsname(out_pipe[0]), O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (out_pipe[1] < 0) throw std::runtime_error("test: cannot open the pseudo-terminal");
  }
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out_pipe[1], STDOUT_FILENO);
    ::dup2(err_pipe[1], STDERR_FILENO);
    if (options.clear_launch_env) {
      for (const char* name : kLaunchVars) ::unsetenv(name);
    }
    for (const auto& [name, value] : options.env) {
      if (value.empty()) {
        ::unsetenv(name.c_str());
      } else {
        ::setenv(name.c_str(), value.c_str(), 1);
      }
    }
    std::vector<char*> args;
    for (const auto& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::fprintf(stderr, "test: cannot execute %s: %s\n", args[0], std::strerror(errno));
    std::_Exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  RunResult result;
  std::array<pollfd, 2> fds = {pollfd{out_pipe[0], POLLIN, 0}, pollfd{err_pipe[0], POLLIN, 0}};
  int open_streams = 2;
  bool killed = false;
  while (open_streams > 0) {
    const auto waited = std::chrono::steady_clock::now() - start;
    if (!killed && waited > options.timeout) {
      ::kill(pid, SIGKILL);
      killed = true;
      result.err += "\n[test: killed after the timeout]\n";
    }
    if (::poll(fds.data(), fds.size(), 200) < 0 && errno != EINTR) break;
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      std::array<char, 4096> buffer{};
      const ssize_t got = ::read(fds[i].fd, buffer.data(), buffer.size());
      if (got <= 0) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_streams;
        continue;
      }
      (i == 0 ? result.out : result.err).append(buffer.data(), static_cast<std::size_t>(got));
    }
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  result.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

int free_port() {
  const int fd = bind_loopback(0);
  const int port = port_of(fd);
  ::close(fd);
  return port;
}

HeldPort::HeldPort() : fd_(bind_loopback(0)), port_(port_of(fd_)) {}

HeldPort::~HeldPort() { ::close(fd_); }

}  // namespace mdist::testing
