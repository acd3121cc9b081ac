// Runs the job once the ranks are started: forwards their output, watches for exits and
// signals, and applies the exit policy (first failure stops everyone; no process outlives us).
#pragma once

#include <array>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "output_prefixer.h"
#include "rank_process.h"
#include "signal_watcher.h"
#include "unique_fd.h"

namespace mdist::launcher {

class Supervisor {
 public:
  Supervisor(std::vector<RankProcess> ranks, SignalWatcher& signals,
             std::chrono::milliseconds kill_timeout);

  // Returns the launcher's exit code: 0 if every rank exited 0; the first failed rank's code
  // (128 + signal for a death by signal); 128 + signo if the launcher itself was signalled.
  // On return every rank, and every process they started, has been killed and reaped.
  [[nodiscard]] int run();
  // Whether the launcher itself was signalled (SIGINT, SIGTERM, SIGHUP): no restart then.
  [[nodiscard]] bool interrupted() const { return interrupted_; }

 private:
  struct Stream {
    UniqueFd fd;
    OutputPrefixer prefixer;
    int destination;  // STDOUT_FILENO or STDERR_FILENO of the launcher
  };
  struct Rank {
    RankProcess process;
    std::vector<Stream> streams;
    std::optional<ExitStatus> exit;
  };
  using Clock = std::chrono::steady_clock;

  // One poll() round: forwards available output, then handles pending signals (incl. SIGCHLD).
  void wait_and_dispatch();
  void flush_remaining_output();
  [[nodiscard]] bool any_running() const;
  [[nodiscard]] int poll_timeout_ms() const;
  void on_signal(int signo);
  void check_exits();
  // One read(); true if data arrived. False: nothing there now, or EOF/error (stream closed).
  bool read_stream(Stream& stream);
  void drain(Rank& rank);
  void close_stream(Stream& stream);
  void forward(int destination, const std::string& text);
  void begin_shutdown(int signo);
  void signal_running(int signo);
  void kill_running_now();
  void kill_everything_and_reap();

  std::vector<Rank> ranks_;
  SignalWatcher& signals_;
  std::chrono::milliseconds kill_timeout_;
  std::optional<int> exit_code_;               // set by the first failure or signal
  std::optional<Clock::time_point> deadline_;  // SIGKILL time once shutting down
  bool killed_ = false;                        // SIGKILL already sent
  bool interrupted_ = false;                   // the launcher received a signal
  std::array<bool, 3> output_broken_{};        // indexed by destination fd; true after EPIPE etc.
};

}  // namespace mdist::launcher
