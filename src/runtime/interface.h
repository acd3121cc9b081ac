#pragma once
// Private: which local address and interface a rank's Gloo pairs use. A host name often
// resolves to 127.0.0.1 (or Debian's 127.0.1.1), so Gloo's default device would publish a
// loopback address to ranks on other nodes and their full-mesh connect would time out; the
// address the kernel routes toward MASTER_ADDR is one that the other nodes can reach.
#include <optional>
#include <string>

namespace mdist::detail {

// A local endpoint for Gloo: a numeric address on this host and the interface that holds it.
struct LocalRoute {
  std::string address;      // numeric, e.g. "10.231.0.2" or "fd00::2" (no scope suffix)
  std::string interface;    // e.g. "eth0"; empty when no interface holds the address
  bool link_local = false;  // an IPv6 fe80:: address: only usable together with its interface
};

// The source address the kernel picks for traffic to `host`:`port` (a numeric IPv4 or IPv6
// address or a host name, tried in getaddrinfo's order). No packet is sent: connecting a UDP
// socket only selects the route. Empty with `why` set when `host` does not resolve or has no
// route.
std::optional<LocalRoute> route_toward(const std::string& host, int port, std::string& why);

// The interface holding the numeric local address `address`; empty when none does.
std::string interface_holding(const std::string& address);

}  // namespace mdist::detail
