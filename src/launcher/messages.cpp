#include "messages.h"

#include <unistd.h>

#include <string>

#include "unique_fd.h"

namespace mdist::launcher {

void report(std::string_view message) noexcept {
  try {
    std::string line = "mdistrun: ";
    line.append(message);
    line.push_back('\n');
    write_all(STDERR_FILENO, line);
  } catch (...) {
    // Out of memory while building a diagnostic: nothing better to do than drop it.
  }
}

}  // namespace mdist::launcher
