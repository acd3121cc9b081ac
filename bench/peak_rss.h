#pragma once
// Peak resident memory of this process (Linux): the VmHWM line of /proc/self/status, which
// the kernel keeps for the whole life of the process (so it includes model construction)
// unless reset_peak_rss() restarts it.
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

namespace mdist::bench {

// One "Vm...:" line of /proc/self/status in MiB (NaN when absent).
inline double status_mib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      std::istringstream fields(line.substr(field.size() + 1));
      double kib = 0;
      fields >> kib;
      return kib / 1024.0;
    }
  }
  return std::numeric_limits<double>::quiet_NaN();
}

inline double peak_rss_mib() { return status_mib("VmHWM"); }

// Resident memory now (VmRSS).
inline double rss_mib() { return status_mib("VmRSS"); }

// Restarts the peak (VmHWM) from the current resident size (Linux >= 4.0), so that
// peak_rss_mib() then measures one phase. False when the kernel refuses.
inline bool reset_peak_rss() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  clear_refs.flush();
  return static_cast<bool>(clear_refs);
}

}  // namespace mdist::bench
