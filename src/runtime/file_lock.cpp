// FileLock: an O_EXCL lock file, polled while another process holds it.
#include "mdist/runtime/file_lock.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "mdist/error.h"

namespace mdist {

FileLock::FileLock(std::filesystem::path lockfile_path, FileLockOptions options)
    : path_(std::move(lockfile_path)), options_(options) {
  if (options_.poll_time <= std::chrono::milliseconds(0)) {
    throw Error("mdist: FileLock " + path_.string() + ": poll_time must be positive, got " +
                std::to_string(options_.poll_time.count()) + " ms");
  }
}

FileLock::~FileLock() {
  try {
    release();
  } catch (...) {
    // A destructor must not throw; the file is gone or was never ours.
  }
}

bool FileLock::try_acquire() {
  if (held()) return true;
  const int fd = ::open(path_.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
  if (fd >= 0) {
    fd_ = fd;
    return true;
  }
  if (errno == EEXIST) return false;
  throw Error("mdist: FileLock: cannot create " + path_.string() + ": " + std::strerror(errno));
}

void FileLock::wait() const { wait_until(deadline()); }

bool FileLock::acquire() {
  const auto until = deadline();  // one limit for the whole acquisition, not per wait
  while (!try_acquire() && options_.all_acquire) wait_until(until);
  return held();
}

std::optional<std::chrono::steady_clock::time_point> FileLock::deadline() const {
  if (!options_.timeout) return std::nullopt;
  return std::chrono::steady_clock::now() + *options_.timeout;
}

void FileLock::wait_until(std::optional<std::chrono::steady_clock::time_point> until) const {
  std::error_code error;
  while (std::filesystem::exists(path_, error)) {
    if (until && std::chrono::steady_clock::now() >= *until) {
      throw Error("mdist: FileLock: " + path_.string() + " is still held after " +
                  std::to_string(options_.timeout->count()) +
                  " ms; remove it if no process holds it (one that died leaves it behind)");
    }
    std::this_thread::sleep_for(options_.poll_time);
  }
}

void FileLock::release() {
  if (!held()) return;
  ::close(fd_);
  fd_ = -1;
  std::error_code error;
  std::filesystem::remove(path_, error);  // absent already: someone removed it by hand
}

}  // namespace mdist
