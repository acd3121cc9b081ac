// See mdist/io/mapped_file.h.
#include "mdist/io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

namespace mdist::io {

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw FileError("open", path, errno);
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const int error = errno;
    ::close(fd);
    throw FileError("stat", path, error);
  }
  size_ = static_cast<std::size_t>(info.st_size);
  if (size_ > 0) {  // mmap rejects a length of 0
    void* mapped = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (mapped == MAP_FAILED) {
      const int error = errno;
      ::close(fd);
      throw FileError("mmap", path, error);
    }
    data_ = static_cast<const unsigned char*>(mapped);
  }
  ::close(fd);  // the mapping keeps the file open
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void MappedFile::release(std::size_t offset, std::size_t length) const {
  if (data_ == nullptr || length == 0 || offset >= size_) return;
  static const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t begin = offset / page * page;
  // The kernel rounds the length up to whole pages; the mapping covers the last partial page.
  const std::size_t end = std::min(size_, offset + std::min(length, size_ - offset));
  (void)::madvise(const_cast<unsigned char*>(data_) + begin, end - begin, MADV_DONTNEED);
}

}  // namespace mdist::io
