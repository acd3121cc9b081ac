#include "signal_watcher.h"

#include <sys/signalfd.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <string>
#include <system_error>

namespace mdist::launcher {

SignalWatcher::SignalWatcher() {
  // If our parent left SIGCHLD ignored, the kernel would reap ranks behind our back and we
  // could never learn their exit status.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(SIGCHLD, &dfl, nullptr);

  sigset_t watched;
  sigemptyset(&watched);
  sigaddset(&watched, SIGCHLD);
  for (const int signo : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) {
    struct sigaction current {};
    ::sigaction(signo, nullptr, &current);
    if (current.sa_handler != SIG_IGN) sigaddset(&watched, signo);
  }
  if (::sigprocmask(SIG_BLOCK, &watched, &original_mask_) != 0) {
    throw std::system_error(errno, std::generic_category(), "sigprocmask");
  }
  fd_.reset(::signalfd(-1, &watched, SFD_NONBLOCK | SFD_CLOEXEC));
  if (!fd_) {
    const int error = errno;
    ::sigprocmask(SIG_SETMASK, &original_mask_, nullptr);
    throw std::system_error(error, std::generic_category(), "signalfd");
  }
}

SignalWatcher::~SignalWatcher() { ::sigprocmask(SIG_SETMASK, &original_mask_, nullptr); }

std::vector<int> SignalWatcher::take_pending() {
  std::vector<int> signals;
  std::array<signalfd_siginfo, 16> infos{};
  for (;;) {
    const ssize_t n = ::read(fd_.get(), infos.data(), sizeof(infos));
    if (n <= 0) break;  // EAGAIN: drained
    const auto count = static_cast<std::size_t>(n) / sizeof(signalfd_siginfo);
    for (std::size_t i = 0; i < count; ++i) signals.push_back(static_cast<int>(infos[i].ssi_signo));
  }
  return signals;
}

std::string signal_name(int signo) {
  if (const char* const abbrev = ::sigabbrev_np(signo); abbrev != nullptr) {
    return std::string("SIG") + abbrev;
  }
  return "signal " + std::to_string(signo);
}

}  // namespace mdist::launcher
