#pragma once
// Replacing a file atomically: the new contents go to a temporary file beside the target, which
// is fsynced, renamed over the target, and the directory fsynced. A reader (or a process after a
// crash or power loss) sees the old file or the whole new one, never a part; a failed write
// leaves the old file as it was and no temporary file behind.
//
//   mdist::io::write_file_atomically(dir / "config.json", text);
//
//   mdist::io::AtomicFile out(path);          // streaming: many writes, then commit()
//   for (const auto& chunk : chunks) out.write(chunk);
//   out.commit();                             // not reached: ~AtomicFile removes the temporary
//
// Failures throw mdist::io::FileError naming the operation, the file and strerror.
#include <cstddef>
#include <filesystem>
#include <string_view>

#include "mdist/io/file_error.h"

namespace mdist::io {

// A file written under a temporary name in the target's directory (the same file system, so the
// rename is atomic), renamed over the target by commit(). The temporary file is removed by the
// destructor unless committed, so an exception between construction and commit() leaves nothing.
class AtomicFile {
 public:
  // Creates the temporary file .NAME.tmp.PID.RANDOM beside `path` (mode 0644, never an existing
  // file). Throws FileError ("create temporary file").
  explicit AtomicFile(std::filesystem::path path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Appends bytes. Throws FileError ("write").
  void write(const void* data, std::size_t size);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }

  // fsync and close: the contents are durable under the temporary name, not yet visible. For
  // writers of several files that become visible together: finish() them all (any may still
  // fail), then commit() them. Throws FileError ("fsync", "close"). Once only.
  void finish();
  // finish() if not done, rename over the target, then fsync the directory so that the rename
  // itself survives a power loss. Throws FileError ("rename"); after it the temporary file is
  // the target and the destructor leaves it.
  void commit();

  const std::filesystem::path& path() const { return path_; }
  const std::filesystem::path& temp_path() const { return temp_; }

 private:
  std::filesystem::path path_;
  std::filesystem::path temp_;
  int fd_ = -1;
  bool finished_ = false;
  bool committed_ = false;
};

// Writes `contents` to `path` through an AtomicFile: `path` holds the old file or the whole new
// one, never a part.
void write_file_atomically(const std::filesystem::path& path, std::string_view contents);

// fsyncs a directory, so that renames and removals in it survive a power loss. Best effort: by the
// time a caller syncs, the change is made, and a failure to make it durable leaves nothing to undo
// (the empty path is the current directory).
void sync_directory(const std::filesystem::path& dir);

}  // namespace mdist::io
