#include "rank_process.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "launch_error.h"
#include "signal_watcher.h"

namespace mdist::launcher {
namespace {

// What the child sends back when it cannot exec; nothing arrives on success (CLOEXEC).
struct ChildFailure {
  enum class Stage : int { kSetup, kExec };
  Stage stage;
  int error;
  const char* what;  // static string naming the failed call (same address space until exec)
};

[[noreturn]] void child_fail(int report_fd, ChildFailure::Stage stage, const char* what) {
  const ChildFailure failure{stage, errno, what};
  // A short write to a pipe is atomic; if even this fails the parent sees EOF + exit 127.
  [[maybe_unused]] const ssize_t ignored = ::write(report_fd, &failure, sizeof(failure));
  ::_exit(127);
}

// Puts `fd` at `target` without CLOEXEC (dup2 clears it; a same-numbered fd needs fcntl).
bool install_fd(int fd, int target) {
  if (fd == target) return ::fcntl(fd, F_SETFD, 0) == 0;
  return ::dup2(fd, target) == target;
}

// Runs in the child between fork and exec. Only async-signal-safe calls: every allocation was
// done by the parent beforehand.
[[noreturn]] void exec_child(const SpawnSpec& spec, char* const* argv, char* const* envp,
                             pid_t launcher_pid, int stdout_fd, int stderr_fd, int report_fd) {
  using Stage = ChildFailure::Stage;
  // Own process group: the launcher can signal the rank together with its subprocesses, and a
  // terminal's Ctrl-C reaches only the launcher, which forwards it exactly once.
  if (::setpgid(0, 0) != 0) child_fail(report_fd, Stage::kSetup, "setpgid");
  // Die with the launcher even if it is SIGKILLed. If it died before prctl took effect we would
  // already have been re-parented, hence the getppid() check.
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) child_fail(report_fd, Stage::kSetup, "prctl");
  if (::getppid() != launcher_pid) ::_exit(127);
  if (!install_fd(stdout_fd, STDOUT_FILENO)) child_fail(report_fd, Stage::kSetup, "dup2");
  if (!install_fd(stderr_fd, STDERR_FILENO)) child_fail(report_fd, Stage::kSetup, "dup2");
  // Like torchrun (subprocess close_fds=True): fds our own parent leaked to us without CLOEXEC
  // do not reach the program. Marked CLOEXEC rather than closed, so the report pipe stays
  // usable until exec. Best effort: kernels before 5.11 lack the flag.
  ::close_range(STDERR_FILENO + 1, ~0U, CLOSE_RANGE_CLOEXEC);
  if (spec.inherited_fd >= 0 && ::fcntl(spec.inherited_fd, F_SETFD, 0) != 0) {
    child_fail(report_fd, Stage::kSetup, "fcntl(F_SETFD)");
  }
  // The launcher ignores SIGPIPE (a closed stdout must not kill it); programs expect the default.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(SIGPIPE, &dfl, nullptr);
  if (spec.signal_mask != nullptr) ::sigprocmask(SIG_SETMASK, spec.signal_mask, nullptr);
  ::execvpe(argv[0], argv, envp);
  child_fail(report_fd, Stage::kExec, "exec");
}

std::vector<char*> as_c_strings(const std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  pointers.reserve(strings.size() + 1);
  for (const std::string& s : strings) pointers.push_back(const_cast<char*>(s.c_str()));
  pointers.push_back(nullptr);
  return pointers;
}

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

}  // namespace

std::string ExitStatus::describe() const {
  if (signaled) {
    return "was killed by signal " + std::to_string(value) + " (" + signal_name(value) + ")";
  }
  return "exited with code " + std::to_string(value);
}

RankProcess::RankProcess(pid_t pid, int global_rank, UniqueFd stdout_pipe,
                         UniqueFd stderr_pipe) noexcept
    : pid_(pid),
      global_rank_(global_rank),
      stdout_pipe_(std::move(stdout_pipe)),
      stderr_pipe_(std::move(stderr_pipe)) {}

RankProcess::RankProcess(RankProcess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      global_rank_(other.global_rank_),
      reaped_(std::exchange(other.reaped_, true)),
      stdout_pipe_(std::move(other.stdout_pipe_)),
      stderr_pipe_(std::move(other.stderr_pipe_)) {}

RankProcess::~RankProcess() {
  if (pid_ <= 0 || reaped_) return;
  signal_group(SIGKILL);
  while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
  }
}

void RankProcess::signal_group(int signo) const noexcept {
  if (pid_ > 0 && !reaped_) ::kill(-pid_, signo);
}

std::optional<ExitStatus> RankProcess::check_exited() const noexcept {
  if (pid_ <= 0) return std::nullopt;
  siginfo_t info{};
  if (::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) != 0 ||
      info.si_pid != pid_) {
    return std::nullopt;
  }
  return ExitStatus{.signaled = info.si_code != CLD_EXITED, .value = info.si_status};
}

RankProcess spawn_rank(const SpawnSpec& spec) {
  const std::vector<char*> argv = as_c_strings(spec.argv);
  const std::vector<char*> envp = as_c_strings(spec.env);
  Pipe out = make_pipe(O_CLOEXEC);
  Pipe err = make_pipe(O_CLOEXEC);
  Pipe report = make_pipe(O_CLOEXEC);
  const pid_t launcher_pid = ::getpid();

  const pid_t pid = ::fork();
  if (pid < 0) {
    throw LaunchError(
        "cannot start rank " + std::to_string(spec.global_rank) + ": fork: " + std::strerror(errno),
        1);
  }
  if (pid == 0) {
    exec_child(spec, argv.data(), envp.data(), launcher_pid, out.write_end.get(),
               err.write_end.get(), report.write_end.get());
  }
  // Also from the parent, so the group exists before we might signal it (no race with the
  // child's own setpgid). EACCES just means the child already exec'd after doing it itself.
  ::setpgid(pid, pid);
  // Own the child immediately so any exception below still kills and reaps it.
  RankProcess rank(pid, spec.global_rank, std::move(out.read_end), std::move(err.read_end));
  out.write_end.reset();
  err.write_end.reset();
  report.write_end.reset();

  ChildFailure failure{};
  ssize_t n = 0;
  do {
    n = ::read(report.read_end.get(), &failure, sizeof(failure));
  } while (n < 0 && errno == EINTR);
  if (n == 0) {  // EOF: exec succeeded and closed the CLOEXEC write end
    set_nonblocking(rank.stdout_pipe().get());
    set_nonblocking(rank.stderr_pipe().get());
    return rank;
  }
  if (n == static_cast<ssize_t>(sizeof(failure)) && failure.stage == ChildFailure::Stage::kExec) {
    throw LaunchError("cannot execute '" + spec.argv.front() + "': " + std::strerror(failure.error),
                      127);
  }
  const std::string detail = n == static_cast<ssize_t>(sizeof(failure))
                                 ? std::string(failure.what) + ": " + std::strerror(failure.error)
                                 : "child setup failed";
  throw LaunchError("cannot start rank " + std::to_string(spec.global_rank) + ": " + detail, 1);
}

}  // namespace mdist::launcher
