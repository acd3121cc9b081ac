#include "src/cli/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "src/cli/input_error.h"

namespace mdist::cli {

MappedFile::MappedFile(const std::filesystem::path& path, const char* what) : path_(path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    throw InputError(std::string(what) + " '" + path.string() + "' does not exist");
  }
  if (std::filesystem::is_directory(path, ec)) {
    throw InputError(std::string(what) + " '" + path.string() + "' is a directory");
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw InputError("cannot read " + std::string(what) + " '" + path.string() +
                     "': " + std::strerror(errno));
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const int error = errno;
    ::close(fd);
    throw InputError("cannot read " + std::string(what) + " '" + path.string() +
                     "': " + std::strerror(error));
  }
  size_ = static_cast<std::size_t>(info.st_size);
  if (size_ > 0) {
    void* mapped = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (mapped == MAP_FAILED) {
      const int error = errno;
      ::close(fd);
      throw InputError("cannot map " + std::string(what) + " '" + path.string() +
                       "': " + std::strerror(error));
    }
    data_ = static_cast<const unsigned char*>(mapped);
  }
  ::close(fd);  // the mapping keeps the file open
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
}

void MappedFile::release(std::size_t offset, std::size_t length) const {
  if (data_ == nullptr || length == 0 || offset >= size_) return;
  static const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t begin = offset / page * page;
  const std::size_t end = std::min(size_, offset + length);
  // Best effort: a failure leaves the pages resident, which is only memory.
  (void)::madvise(const_cast<unsigned char*>(data_) + begin, end - begin, MADV_DONTNEED);
}

}  // namespace mdist::cli
