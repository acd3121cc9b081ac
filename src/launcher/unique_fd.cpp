#include "unique_fd.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace mdist::launcher {

void UniqueFd::reset(int fd) noexcept {
  if (fd_ >= 0 && fd_ != fd) {
    // Linux always releases the fd, even when close() reports EINTR, so never retry.
    ::close(fd_);
  }
  fd_ = fd;
}

Pipe make_pipe(int flags) {
  int fds[2];
  if (::pipe2(fds, flags) != 0) throw std::system_error(errno, std::generic_category(), "pipe2");
  return Pipe{UniqueFd(fds[0]), UniqueFd(fds[1])};
}

bool write_all(int fd, std::string_view data) noexcept {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n >= 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      // Our stdout may be a non-blocking fd shared with someone else: wait instead of dropping.
      pollfd pfd{.fd = fd, .events = POLLOUT, .revents = 0};
      ::poll(&pfd, 1, -1);
      continue;
    }
    return false;
  }
  return true;
}

}  // namespace mdist::launcher
