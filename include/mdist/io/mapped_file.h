#pragma once
// A file mapped read-only into memory (RAII), for files far larger than a process's memory:
// pages come from the page cache on demand, and release() hands pages already read back to the
// kernel so that they stop counting in this process's resident set (a scan of a 2 GiB file then
// peaks at one chunk, not at the file; a loader that reads each tensor once never holds the
// whole checkpoint).
//
// The file must not be truncated or rewritten in place while mapped (touching a page past its
// new end raises SIGBUS, as for any mmap); mdist replaces files by rename (atomic_file.h), which
// leaves a mapping of the old file intact.
#include <cstddef>
#include <filesystem>

#include "mdist/io/file_error.h"

namespace mdist::io {

class MappedFile {
 public:
  // Maps the whole of `path` (an empty file maps to data() == nullptr, size() == 0). Throws
  // FileError ("open", "stat" or "mmap"). Anything that can be opened and mapped is accepted:
  // callers that need a regular file check that first.
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  // Moving hands the mapping over; the moved-from object is empty.
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;

  const unsigned char* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

  // Drops the pages of [offset, offset + length) from this process's resident set (madvise
  // MADV_DONTNEED): they stay in the page cache, and reading them again maps them again. Whole
  // pages: a page the range only partly covers is dropped too, which costs nothing but a later
  // page fault. Ranges past the end are clipped. Advice only: a failure is ignored, since it
  // leaves the pages resident, which is only memory.
  void release(std::size_t offset, std::size_t length) const;

 private:
  std::filesystem::path path_;
  const unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace mdist::io
