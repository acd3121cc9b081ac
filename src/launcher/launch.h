// Runs a whole job described by LaunchOptions: rendezvous socket, ranks, supervision.
#pragma once

#include "options.h"

namespace mdist::launcher {

// Returns the launcher's exit code. Throws LaunchError for failures before the ranks run
// (port in use, program not executable, ...), after killing anything already started.
[[nodiscard]] int launch(const LaunchOptions& options);

}  // namespace mdist::launcher
