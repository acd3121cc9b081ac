#pragma once
// The run directory of `mdist train` as something a run owns: a lock that keeps a second run
// out while one is writing, the test for an earlier run that a fresh run must not replace
// without --overwrite, and the replacement itself.
#include <filesystem>
#include <optional>
#include <string>

namespace mdist::cli {

// An exclusive flock(2) on RUN/.mdist.lock, held for the object's life (the kernel releases it
// when the process dies, so a crash never leaves a stale lock). The file holds the holder's
// pid, for the message of the run that is kept out.
class RunLock {
 public:
  // Creates the directory and the lock file; throws InputError naming the holder's pid when
  // another process holds it.
  explicit RunLock(const std::filesystem::path& run_dir);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  // Without creating anything: throws InputError if another process holds the lock. Several
  // processes may check at once.
  static void check_free(const std::filesystem::path& run_dir);

 private:
  int fd_ = -1;
};

// What of an earlier run `run_dir` holds ("metrics.jsonl and 3 checkpoints"), if anything:
// its metrics file or any checkpoint directory.
std::optional<std::string> earlier_run(const std::filesystem::path& run_dir);

// Removes what a run writes (metrics.jsonl, loss.svg, checkpoints/); nothing else.
void remove_earlier_run(const std::filesystem::path& run_dir);

// Whether `path` is `dir` or lies inside it (both resolved: symlinks, "..").
bool is_within(const std::filesystem::path& path, const std::filesystem::path& dir);

}  // namespace mdist::cli
