// libFuzzer target for the safetensors reader (mdist/hf/safetensors.h, src/hf/safetensors.cpp).
//
// The input is a whole .safetensors file (seeds: tests/hf/fixtures). Opening it must either
// succeed or throw mdist::hf::SafetensorsError; anything else -- another exception, a
// sanitizer report, a read outside the mapping (SIGSEGV/SIGBUS) -- is a bug and crashes.
// For a file that opens, every tensor is read whole and by rows, and the bytes must agree.
#include <sys/mman.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "mdist/hf/safetensors.h"

namespace {

[[noreturn]] void fail(const char* what, const std::string& name) {
  std::fprintf(stderr, "safetensors_fuzzer: %s (tensor %s)\n", what, name.c_str());
  std::abort();
}

int memory_file() {
  static const int fd = ::memfd_create("safetensors_fuzzer", MFD_CLOEXEC);
  if (fd < 0) {
    std::perror("memfd_create");
    std::abort();
  }
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const int fd = memory_file();
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) {
    std::perror("memfd write");
    std::abort();
  }
  try {
    const mdist::hf::SafetensorsFile file("/proc/self/fd/" + std::to_string(fd));
    for (const auto& name : file.names()) {
      const auto& info = file.info(name);
      // Raw bytes are compared, not values: clone() would normalise BOOL bytes other than
      // 0/1, which the reader passes through unchecked (as the official library does).
      const at::Tensor whole = file.tensor(name);
      if (!whole.is_contiguous()) fail("tensor() is not contiguous", name);
      if (static_cast<std::uint64_t>(whole.nbytes()) != info.end - info.begin) {
        fail("tensor() has the wrong byte size", name);
      }
      if (!info.shape.empty()) {
        const at::Tensor rows = file.read_rows(name, 0, info.shape[0]);
        if (rows.nbytes() != whole.nbytes() ||
            (whole.nbytes() > 0 &&
             std::memcmp(rows.data_ptr(), whole.data_ptr(), whole.nbytes()) != 0)) {
          fail("read_rows of all rows differs from tensor()", name);
        }
      }
    }
    (void)file.metadata();
  } catch (const mdist::hf::SafetensorsError&) {
  }
  return 0;
}
