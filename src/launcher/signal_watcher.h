// Turns the signals the launcher reacts to into readable events on an fd (signalfd), so the
// supervisor's single poll() loop wakes up for them without async-signal-safety concerns.
#pragma once

#include <signal.h>

#include <string>
#include <vector>

#include "unique_fd.h"

namespace mdist::launcher {

class SignalWatcher {
 public:
  // Blocks SIGCHLD and the terminating signals (SIGINT, SIGTERM, SIGHUP, SIGQUIT) and opens a
  // signalfd for them. A terminating signal that was ignored when mdistrun started (nohup, a
  // non-interactive shell's `&`) stays ignored, so `nohup mdistrun ...` survives a hangup.
  SignalWatcher();
  ~SignalWatcher();
  SignalWatcher(const SignalWatcher&) = delete;
  SignalWatcher& operator=(const SignalWatcher&) = delete;

  [[nodiscard]] int fd() const noexcept { return fd_.get(); }
  // The mask to restore in children before exec (blocked signals survive exec).
  [[nodiscard]] const sigset_t& original_mask() const noexcept { return original_mask_; }
  // Signal numbers received since the last call, in arrival order (never blocks).
  [[nodiscard]] std::vector<int> take_pending();

 private:
  sigset_t original_mask_{};
  UniqueFd fd_;
};

// "SIGSEGV" for 11 etc.; "signal N" when the number has no name.
[[nodiscard]] std::string signal_name(int signo);

}  // namespace mdist::launcher
