#pragma once
// What a training or tokenizing job reports of its memory.

namespace mdist::train {

// Peak resident set size of this process (VmHWM of /proc/self/status), MiB; 0 where the
// kernel does not report it.
double peak_rss_mib();

}  // namespace mdist::train
