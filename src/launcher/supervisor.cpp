#include "supervisor.h"

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <fstream>
#include <system_error>
#include <utility>

#include "messages.h"

namespace mdist::launcher {
namespace {

// Bounds how long drain() may spin on a pipe that someone (a rank's leftover subprocess) keeps
// refilling; anything beyond is picked up by the main loop later.
constexpr int kMaxDrainReads = 64;
constexpr std::size_t kReadChunk = std::size_t{64} * 1024;

// Our direct children (ranks, plus orphans re-parented to us as a child subreaper), or nullopt
// if the kernel does not provide the list (CONFIG_PROC_CHILDREN).
std::optional<std::vector<pid_t>> list_children() {
  // The launcher is single-threaded, so its main thread's list is the whole list.
  std::ifstream file("/proc/self/task/" + std::to_string(::getpid()) + "/children");
  if (!file) return std::nullopt;
  std::vector<pid_t> children;
  for (pid_t pid = 0; file >> pid;) children.push_back(pid);
  return children;
}

}  // namespace

Supervisor::Supervisor(std::vector<RankProcess> ranks, SignalWatcher& signals,
                       std::chrono::milliseconds kill_timeout)
    : signals_(signals), kill_timeout_(kill_timeout) {
  ranks_.reserve(ranks.size());
  for (RankProcess& process : ranks) {
    const int rank = process.global_rank();
    std::vector<Stream> streams;
    streams.push_back(
        Stream{std::move(process.stdout_pipe()), OutputPrefixer(rank), STDOUT_FILENO});
    streams.push_back(
        Stream{std::move(process.stderr_pipe()), OutputPrefixer(rank), STDERR_FILENO});
    ranks_.push_back(Rank{std::move(process), std::move(streams), std::nullopt});
  }
}

int Supervisor::run() {
  while (any_running()) {
    wait_and_dispatch();
    if (deadline_ && !killed_ && Clock::now() >= *deadline_) kill_running_now();
  }
  kill_everything_and_reap();
  flush_remaining_output();
  return exit_code_.value_or(0);
}

void Supervisor::wait_and_dispatch() {
  std::vector<pollfd> fds = {pollfd{.fd = signals_.fd(), .events = POLLIN, .revents = 0}};
  std::vector<Stream*> fd_owners;  // fd_owners[i] owns fds[i + 1]
  for (Rank& rank : ranks_) {
    for (Stream& stream : rank.streams) {
      if (!stream.fd) continue;
      fds.push_back(pollfd{.fd = stream.fd.get(), .events = POLLIN, .revents = 0});
      fd_owners.push_back(&stream);
    }
  }
  if (::poll(fds.data(), fds.size(), poll_timeout_ms()) < 0 && errno != EINTR) {
    throw std::system_error(errno, std::generic_category(), "poll");
  }
  // Output first, so a rank's last lines are printed before the launcher reports its exit.
  for (std::size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents != 0) read_stream(*fd_owners[i - 1]);
  }
  if (fds[0].revents != 0) {
    for (const int signo : signals_.take_pending()) on_signal(signo);
  }
}

void Supervisor::flush_remaining_output() {
  // Every writer is gone now, so this reaches EOF (or EAGAIN if an unrelated process somehow
  // holds a pipe, which must not hang us).
  for (Rank& rank : ranks_) {
    for (Stream& stream : rank.streams) {
      while (stream.fd && read_stream(stream)) {
      }
      if (stream.fd) close_stream(stream);
    }
  }
}

bool Supervisor::any_running() const {
  return std::ranges::any_of(ranks_, [](const Rank& rank) { return !rank.exit.has_value(); });
}

int Supervisor::poll_timeout_ms() const {
  if (!deadline_ || killed_) return -1;  // only SIGCHLD, signals and output can wake us
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline_ - Clock::now());
  return static_cast<int>(std::max<std::chrono::milliseconds::rep>(left.count(), 0));
}

void Supervisor::on_signal(int signo) {
  if (signo == SIGCHLD) {
    check_exits();
    return;
  }
  interrupted_ = true;
  if (!exit_code_) {
    report("received " + signal_name(signo) + "; forwarding it to every rank");
    exit_code_ = 128 + signo;
    begin_shutdown(signo);
  } else if (!killed_) {
    // A second Ctrl-C (or a signal during a failure shutdown) means "stop now".
    report("received " + signal_name(signo) + " while stopping; killing every rank");
    kill_running_now();
  }
}

void Supervisor::check_exits() {
  for (Rank& rank : ranks_) {
    if (rank.exit) continue;
    const std::optional<ExitStatus> status = rank.process.check_exited();
    if (!status) continue;
    drain(rank);
    rank.exit = status;
    // Only the first failure is the root cause; ranks dying from our SIGTERM are not reported.
    if (!status->success() && !exit_code_) {
      report("rank " + std::to_string(rank.process.global_rank()) + " (pid " +
             std::to_string(rank.process.pid()) + ") " + status->describe());
      exit_code_ = status->as_exit_code();
      begin_shutdown(SIGTERM);
    }
  }
}

bool Supervisor::read_stream(Stream& stream) {
  std::array<char, kReadChunk> buffer;  // NOLINT: filled by read() before use
  const ssize_t n = ::read(stream.fd.get(), buffer.data(), buffer.size());
  if (n > 0) {
    std::string text;
    stream.prefixer.feed(std::string_view(buffer.data(), static_cast<std::size_t>(n)), text);
    forward(stream.destination, text);
    return true;
  }
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return false;
  close_stream(stream);  // EOF or a real error: this stream is done
  return false;
}

void Supervisor::drain(Rank& rank) {
  for (Stream& stream : rank.streams) {
    for (int i = 0; i < kMaxDrainReads && stream.fd && read_stream(stream); ++i) {
    }
  }
}

void Supervisor::close_stream(Stream& stream) {
  std::string text;
  stream.prefixer.finish(text);
  forward(stream.destination, text);
  stream.fd.reset();
}

void Supervisor::forward(int destination, const std::string& text) {
  const auto index = static_cast<std::size_t>(destination);
  if (text.empty() || output_broken_[index]) return;
  // If our reader went away (EPIPE) keep running the job; just stop writing to that stream.
  if (!write_all(destination, text)) output_broken_[index] = true;
}

void Supervisor::begin_shutdown(int signo) {
  signal_running(signo);
  deadline_ = Clock::now() + kill_timeout_;
}

void Supervisor::signal_running(int signo) {
  for (const Rank& rank : ranks_) {
    if (!rank.exit) rank.process.signal_group(signo);
  }
}

void Supervisor::kill_running_now() {
  signal_running(SIGKILL);
  killed_ = true;
}

void Supervisor::kill_everything_and_reap() {
  // Subprocesses a rank left behind in its group (the ranks themselves are zombies by now).
  for (const Rank& rank : ranks_) rank.process.signal_group(SIGKILL);
  const auto note_reaped = [this](pid_t pid) {
    for (Rank& rank : ranks_) {
      if (rank.process.pid() == pid) rank.process.mark_reaped();
    }
  };
  // Processes that escaped their group (setsid) were re-parented to us, the child subreaper,
  // when their parent died: kill whatever children we have until none is left.
  for (;;) {
    const std::optional<std::vector<pid_t>> children = list_children();
    if (!children) break;
    for (const pid_t child : *children) ::kill(child, SIGKILL);
    const pid_t pid = ::waitpid(-1, nullptr, 0);
    if (pid > 0) {
      note_reaped(pid);
    } else if (errno != EINTR) {
      return;  // ECHILD: nothing left
    }
  }
  // Fallback without /proc/.../children: reap the ranks (zombies already) and whatever else
  // has exited; the group SIGKILL above already covered everything still attached to a rank.
  for (Rank& rank : ranks_) {
    while (::waitpid(rank.process.pid(), nullptr, 0) < 0 && errno == EINTR) {
    }
    rank.process.mark_reaped();
  }
  for (pid_t pid = 0; (pid = ::waitpid(-1, nullptr, WNOHANG)) > 0;) {
  }
}

}  // namespace mdist::launcher
