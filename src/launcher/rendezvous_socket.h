// The store's listening socket, opened by the launcher on node 0 before any rank starts so the
// port is reserved (nobody can steal it between "pick a port" and "rank 0 binds it") and a
// conflict is reported once, clearly, by the launcher.
#pragma once

#include <cstdint>
#include <string>

#include "options.h"
#include "unique_fd.h"

namespace mdist::launcher {

struct Rendezvous {
  std::string master_addr;        // MASTER_ADDR given to every rank
  std::uint16_t master_port = 0;  // MASTER_PORT given to every rank
  UniqueFd listen_fd;             // listening socket for global rank 0; invalid on node ranks > 0
  std::string warning;            // non-empty: a note for stderr (e.g. an ignored --master-addr)
};

// Single node: binds loopback only. Multi-node: node 0 binds --master-addr's address (all
// interfaces when it is not given or not one of this host's, with a warning); other nodes bind
// nothing.
// Throws LaunchError (exit code 1) when the socket cannot be bound.
[[nodiscard]] Rendezvous open_rendezvous(const LaunchOptions& options);

}  // namespace mdist::launcher
