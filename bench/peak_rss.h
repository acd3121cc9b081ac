#pragma once
// Peak resident memory of this process (Linux): the VmHWM line of /proc/self/status, which
// the kernel keeps for the whole life of the process, so it includes model construction.
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

namespace mdist::bench {

inline double peak_rss_mib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream fields(line.substr(6));
      double kib = 0;
      fields >> kib;
      return kib / 1024.0;
    }
  }
  return std::numeric_limits<double>::quiet_NaN();
}

}  // namespace mdist::bench
