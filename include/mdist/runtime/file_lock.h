#pragma once
// The reference's FileLock: a mutex between processes (ranks of one job, or separate jobs)
// that write the same file, made of a lock file created with O_CREAT | O_EXCL. It works on
// any file system where O_EXCL is atomic, across nodes sharing it too; unlike flock(2), a
// process that dies holding the lock leaves the file behind, so `timeout` bounds the wait.
#include <chrono>
#include <filesystem>
#include <optional>

namespace mdist {

struct FileLockOptions {
  // As the reference's all_acquire: acquire() waits until this process holds the lock. If
  // false, acquire() tries once and returns whether it got the lock.
  bool all_acquire = false;
  // Sleep between looks at the lock file while waiting.
  std::chrono::milliseconds poll_time{250};
  // Beyond the reference: give up waiting after this long with an Error naming the lock file
  // (e.g. one left by a process that died). No limit by default, as the reference.
  std::optional<std::chrono::milliseconds> timeout = std::nullopt;
};

class FileLock {
 public:
  explicit FileLock(std::filesystem::path lockfile_path, FileLockOptions options = {});
  // Releases the lock if this object holds it.
  ~FileLock();
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

  // Creates the lock file if it does not exist; true when this object now holds the lock.
  // Throws Error when the file cannot be created for another reason (no such directory, no
  // permission). True at once if this object already holds it.
  bool try_acquire();
  // Waits until the lock file does not exist (another holder released it).
  void wait() const;
  // The reference's `with FileLock(...)`: try, and with all_acquire wait and try again until
  // held. Returns held().
  bool acquire();
  // Closes and removes the lock file if this object holds it; otherwise does nothing (the
  // reference removes the file even when another process holds it).
  void release();

  bool held() const { return fd_ >= 0; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::optional<std::chrono::steady_clock::time_point> deadline() const;
  void wait_until(std::optional<std::chrono::steady_clock::time_point> until) const;

  std::filesystem::path path_;
  FileLockOptions options_;
  int fd_ = -1;
};

}  // namespace mdist
