// See mdist/train/memory.h.
#include "mdist/train/memory.h"

#include <fstream>
#include <string>

namespace mdist::train {

double peak_rss_mib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0;
}

}  // namespace mdist::train
