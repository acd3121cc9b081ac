#pragma once
// A file mapped read-only into memory (RAII), for data files far larger than a rank's memory:
// pages come from the page cache on demand, and release() hands pages already read back to the
// kernel so that they stop counting in this process's resident set (a scan of a 2 GiB file then
// peaks at one chunk, not at the file).
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace mdist::cli {

class MappedFile {
 public:
  // Throws InputError naming the file (`what` says which file: "data file") when it is missing,
  // a directory, or cannot be opened or mapped.
  MappedFile(const std::filesystem::path& path, const char* what);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const unsigned char* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

  // Drops the pages of [offset, offset + length) from this process's resident set (they stay
  // in the page cache; reading them again maps them again). Whole pages only: a page the range
  // only partly covers is dropped too, which costs nothing but a later page fault.
  void release(std::size_t offset, std::size_t length) const;

 private:
  std::filesystem::path path_;
  const unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace mdist::cli
