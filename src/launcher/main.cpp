// mdistrun: a torchrun-compatible launcher for any executable (see launch.h for the flow).
#include <fcntl.h>
#include <unistd.h>

#include <csignal>
#include <exception>
#include <string>
#include <variant>
#include <vector>

#include "launch.h"
#include "launch_error.h"
#include "messages.h"
#include "options.h"
#include "unique_fd.h"

namespace {

// With fd 0, 1 or 2 closed, our own pipes and sockets could take those numbers and then be
// clobbered by the dup2()s that set up each rank's stdout/stderr.
void ensure_standard_fds_open() {
  for (int fd = STDIN_FILENO; fd <= STDERR_FILENO; ++fd) {
    if (::fcntl(fd, F_GETFD) == -1) {
      const int null_fd = ::open("/dev/null", O_RDWR);  // lowest free number: `fd` itself
      if (null_fd > STDERR_FILENO) ::close(null_fd);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  ensure_standard_fds_open();
  // A closed stdout (e.g. `mdistrun ... | head`) must not kill the launcher and orphan the job.
  ::signal(SIGPIPE, SIG_IGN);

  using namespace mdist::launcher;
  try {
    const std::vector<std::string> args(argv + 1, argv + argc);
    const ParseResult parsed = parse_command_line(args);
    if (const auto* early = std::get_if<EarlyExit>(&parsed)) {
      write_all(early->to_stderr ? STDERR_FILENO : STDOUT_FILENO, early->message);
      return early->exit_code;
    }
    return launch(std::get<LaunchOptions>(parsed));
  } catch (const LaunchError& e) {
    report(e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    report(std::string("internal error: ") + e.what());
    return 1;
  }
}
