// One rank: a child process in its own process group whose stdout/stderr are pipes to us.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "unique_fd.h"

namespace mdist::launcher {

// How a rank ended.
struct ExitStatus {
  bool signaled = false;
  int value = 0;  // exit code, or signal number when `signaled`

  [[nodiscard]] bool success() const { return !signaled && value == 0; }
  // Shell convention: a death by signal N reads as 128 + N.
  [[nodiscard]] int as_exit_code() const { return signaled ? 128 + value : value; }
  // "exited with code 3" / "was killed by signal 11 (SIGSEGV)".
  [[nodiscard]] std::string describe() const;
};

struct SpawnSpec {
  int global_rank = 0;
  std::vector<std::string> argv;  // argv[0] is looked up in PATH like execvp
  std::vector<std::string> env;   // complete environment, "KEY=VALUE"
  // An fd (normally CLOEXEC) that this child alone keeps across exec; -1 for none.
  int inherited_fd = -1;
  // Signal mask for the child: the launcher's blocked signals must not leak into the program.
  const sigset_t* signal_mask = nullptr;
};

class RankProcess {
 public:
  RankProcess(RankProcess&& other) noexcept;
  RankProcess& operator=(RankProcess&& other) = delete;  // no use; would have to kill the old rank
  RankProcess(const RankProcess&) = delete;
  RankProcess& operator=(const RankProcess&) = delete;
  // Safety net for early exits (exceptions): kills the whole group and reaps the rank.
  ~RankProcess();

  [[nodiscard]] pid_t pid() const noexcept { return pid_; }
  [[nodiscard]] int global_rank() const noexcept { return global_rank_; }
  [[nodiscard]] UniqueFd& stdout_pipe() noexcept { return stdout_pipe_; }
  [[nodiscard]] UniqueFd& stderr_pipe() noexcept { return stderr_pipe_; }

  // Sends `signo` to the rank's process group (the rank and whatever it started).
  void signal_group(int signo) const noexcept;
  // The exit status once the rank has exited. The rank is deliberately left a zombie (WNOWAIT):
  // while it is unreaped its pid, and so its process-group id, cannot be reused, which keeps
  // later kill(-pgid) calls aimed at our group and nobody else's.
  [[nodiscard]] std::optional<ExitStatus> check_exited() const noexcept;
  // Tells the object someone else reaped it (waitpid(-1) in the final sweep).
  void mark_reaped() noexcept { reaped_ = true; }

 private:
  friend RankProcess spawn_rank(const SpawnSpec& spec);
  RankProcess(pid_t pid, int global_rank, UniqueFd stdout_pipe, UniqueFd stderr_pipe) noexcept;

  pid_t pid_ = -1;
  int global_rank_ = -1;
  bool reaped_ = false;
  UniqueFd stdout_pipe_;  // read ends, non-blocking
  UniqueFd stderr_pipe_;
};

// Forks and execs one rank. Returns only once the program has been exec'd: a failure in the
// child (exec or setup) is reported back through a CLOEXEC pipe and thrown here as LaunchError
// (exit code 127 for "cannot execute"), so it is printed once by the launcher, not per rank.
[[nodiscard]] RankProcess spawn_rank(const SpawnSpec& spec);

}  // namespace mdist::launcher
