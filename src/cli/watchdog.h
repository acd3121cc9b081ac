#pragma once
// A stalled rank made visible. A thread on every rank posts to the job's store, every quarter of
// the watchdog's time, the step the rank has reached and a heartbeat count; a thread on rank 0
// reads them and prints, once per stall, a rank that has lagged the leading step, or whose
// heartbeat has stopped (SIGSTOP, a frozen node), for longer than the set time: "rank 1 has not
// reached step 7 for 60 s". The collective timeout (--timeout) still decides when the job
// fails; this only says whom the others are waiting for.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace mdist::cli {

class StepWatchdog {
 public:
  // `after`: how long a rank may lag before it is reported; zero disables the watchdog (also
  // in a process that is not part of a job).
  explicit StepWatchdog(std::chrono::milliseconds after);
  ~StepWatchdog();
  StepWatchdog(const StepWatchdog&) = delete;
  StepWatchdog& operator=(const StepWatchdog&) = delete;

  // This rank has reached `step` (no communication: the thread posts it).
  void reached(std::int64_t step);

 private:
  // Every rank: posts (step, heartbeat); rank 0 also checks everyone's.
  void run();
  void check(const std::vector<std::string>& values);

  std::chrono::milliseconds after_;
  bool enabled_ = false;
  std::atomic<std::int64_t> step_{0};
  // rank 0's view of each rank: the last (step, heartbeat) and since when each has not changed.
  struct Seen {
    std::int64_t step = -1, beat = -1;
    std::chrono::steady_clock::time_point step_since, beat_since;
    bool reported = false;
  };
  std::vector<Seen> seen_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace mdist::cli
