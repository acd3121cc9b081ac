#include "src/cli/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "src/cli/input_error.h"

namespace mdist::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kLockName = ".mdist.lock";

std::string holder_of(const fs::path& lock) {
  std::ifstream in(lock);
  std::string pid;
  std::getline(in, pid);
  return pid.empty() ? "an unknown process" : "pid " + pid;
}

[[noreturn]] void in_use(const fs::path& run_dir) {
  throw InputError("output directory '" + run_dir.string() + "' is in use by another run (" +
                   holder_of(run_dir / kLockName) + " holds " + (run_dir / kLockName).string() +
                   ")");
}

}  // namespace

RunLock::RunLock(const fs::path& run_dir) {
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  const fs::path path = run_dir / kLockName;
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    throw InputError("cannot create the lock file '" + path.string() +
                     "': " + std::strerror(errno));
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd_);
    fd_ = -1;
    in_use(run_dir);
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) < 0) {
    // The lock holds without the pid; only the other run's message is poorer.
  }
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

void RunLock::check_free(const fs::path& run_dir) {
  const fs::path path = run_dir / kLockName;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;  // no lock file: free
  // A shared lock: checkers (every rank of a job may check) do not keep each other out; only
  // a holder of the exclusive lock does.
  const bool held = ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);
  if (held) in_use(run_dir);
}

std::optional<std::string> earlier_run(const fs::path& run_dir) {
  std::error_code ec;
  std::string found;
  if (fs::exists(run_dir / "metrics.jsonl", ec)) found = "metrics.jsonl";
  int checkpoints = 0;
  for (const auto& entry : fs::directory_iterator(run_dir / "checkpoints", ec)) {
    if (entry.path().filename().string().rfind("step-", 0) == 0) ++checkpoints;
  }
  if (checkpoints > 0) {
    found += (found.empty() ? "" : " and ") + std::to_string(checkpoints) + " checkpoint" +
             (checkpoints > 1 ? "s" : "");
  }
  if (found.empty()) return std::nullopt;
  return found;
}

void remove_earlier_run(const fs::path& run_dir) {
  for (const char* name :
       {"metrics.jsonl", "loss.svg", "checkpoints", "qat_quantizers.safetensors"}) {
    std::error_code ec;
    fs::remove_all(run_dir / name, ec);
    if (ec) {
      throw InputError("--overwrite: cannot remove '" + (run_dir / name).string() +
                       "': " + ec.message());
    }
  }
}

bool is_within(const fs::path& path, const fs::path& dir) {
  std::error_code ec;
  const fs::path p = fs::weakly_canonical(path, ec);
  const fs::path d = fs::weakly_canonical(dir, ec);
  auto pi = p.begin();
  for (auto di = d.begin(); di != d.end(); ++di, ++pi) {
    if (di->empty()) continue;  // a trailing separator
    if (pi == p.end() || *pi != *di) return false;
  }
  return true;
}

}  // namespace mdist::cli
