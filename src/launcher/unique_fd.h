// Move-only owner of a POSIX file descriptor, plus the few fd helpers the launcher needs.
#pragma once

#include <string_view>
#include <utility>

namespace mdist::launcher {

class UniqueFd {
 public:
  UniqueFd() noexcept = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  ~UniqueFd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  explicit operator bool() const noexcept { return valid(); }

  // Gives up ownership without closing.
  [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }
  // Closes the current fd (if any) and takes ownership of `fd`.
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

struct Pipe {
  UniqueFd read_end;
  UniqueFd write_end;
};

// pipe2() with the given flags (e.g. O_CLOEXEC); throws std::system_error on failure.
[[nodiscard]] Pipe make_pipe(int flags);

// Writes all of `data`, waiting (poll) if `fd` happens to be non-blocking.
// Returns false on a hard error such as EPIPE (the reader went away).
bool write_all(int fd, std::string_view data) noexcept;

}  // namespace mdist::launcher
