// See mdist/io/atomic_file.h.
#include "mdist/io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <random>
#include <string>
#include <utility>

namespace mdist::io {
namespace fs = std::filesystem;

namespace {

fs::path directory_of(const fs::path& path) {
  return path.has_parent_path() ? path.parent_path() : fs::path(".");
}

}  // namespace

AtomicFile::AtomicFile(fs::path path) : path_(std::move(path)) {
  // pid and a random number: unique across the processes of a job that share the directory, and
  // across earlier runs that crashed and left a temporary file behind.
  std::random_device random;
  temp_ = directory_of(path_) / ("." + path_.filename().string() + ".tmp." +
                                 std::to_string(::getpid()) + "." + std::to_string(random()));
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) throw FileError("create temporary file", temp_, errno);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, std::size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t wrote = ::write(fd_, bytes, size);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote < 0) throw FileError("write", temp_, errno);
    bytes += wrote;
    size -= static_cast<std::size_t>(wrote);
  }
}

void AtomicFile::finish() {
  if (::fsync(fd_) != 0) throw FileError("fsync", temp_, errno);
  const int fd = fd_;
  fd_ = -1;
  // close can report a deferred write error (NFS): the data is then not known to be there.
  if (::close(fd) != 0) throw FileError("close", temp_, errno);
  finished_ = true;
}

void AtomicFile::commit() {
  if (!finished_) finish();
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    throw FileError("rename", temp_, errno, path_);
  }
  committed_ = true;
  sync_directory(directory_of(path_));
}

void write_file_atomically(const fs::path& path, std::string_view contents) {
  AtomicFile file(path);
  file.write(contents);
  file.commit();
}

void sync_directory(const fs::path& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fsync(fd);
  ::close(fd);
}

}  // namespace mdist::io
