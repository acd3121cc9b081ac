#include "rendezvous_socket.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>
#include <variant>
#include <vector>

#include "launch_error.h"

namespace mdist::launcher {
namespace {

// Much larger than torchrun's needs for one node, but multi-node jobs connect every rank of
// every node to this socket at once; the kernel clamps it to net.core.somaxconn anyway.
constexpr int kListenBacklog = 16384;

std::optional<in_addr> parse_ipv4(const std::string& text) {
  in_addr addr{};
  if (::inet_pton(AF_INET, text.c_str(), &addr) != 1) return std::nullopt;
  return addr;
}

bool is_loopback(in_addr addr) { return (ntohl(addr.s_addr) >> 24) == 127; }

// An IPv4 or IPv6 socket address (port included).
struct Endpoint {
  sockaddr_storage storage{};
  socklen_t length = 0;

  static Endpoint ipv4(in_addr addr, std::uint16_t port) {
    Endpoint e;
    auto& sa = reinterpret_cast<sockaddr_in&>(e.storage);
    sa.sin_family = AF_INET;
    sa.sin_addr = addr;
    sa.sin_port = htons(port);
    e.length = sizeof(sockaddr_in);
    return e;
  }
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
  int family() const { return storage.ss_family; }
  bool is_loopback() const {
    if (family() == AF_INET6) {
      return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6&>(storage).sin6_addr);
    }
    return launcher::is_loopback(reinterpret_cast<const sockaddr_in&>(storage).sin_addr);
  }
  // "10.0.0.1" or "fd00::1" (no brackets, no port).
  std::string address() const {
    char buffer[INET6_ADDRSTRLEN] = {};
    const void* const raw =
        family() == AF_INET6
            ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6&>(storage).sin6_addr)
            : static_cast<const void*>(&reinterpret_cast<const sockaddr_in&>(storage).sin_addr);
    ::inet_ntop(family(), raw, buffer, sizeof(buffer));
    return buffer;
  }
  std::string with_port(std::uint16_t port) const {
    const std::string host = family() == AF_INET6 ? "[" + address() + "]" : address();
    return host + ":" + std::to_string(port);
  }
};

// The addresses `host` (numeric or a name) resolves to, in getaddrinfo's order.
std::vector<Endpoint> resolve(const std::string& host, std::uint16_t port, std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    why = ::gai_strerror(rc);
    return {};
  }
  std::vector<Endpoint> endpoints;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if ((a->ai_family != AF_INET && a->ai_family != AF_INET6) ||
        a->ai_addrlen > sizeof(sockaddr_storage)) {
      continue;
    }
    Endpoint e;
    std::memcpy(&e.storage, a->ai_addr, a->ai_addrlen);
    e.length = a->ai_addrlen;
    endpoints.push_back(e);
  }
  ::freeaddrinfo(found);
  return endpoints;
}

// Binds and listens; on failure, the errno (the socket is closed).
std::variant<UniqueFd, int> try_listen(const Endpoint& endpoint) {
  // CLOEXEC: only rank 0 may inherit it; the spawner clears the flag in that one child.
  UniqueFd fd(::socket(endpoint.family(), SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return errno;
  // Lets a new job reuse the port of a previous one whose connections linger in TIME_WAIT.
  const int one = 1;
  if (::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) return errno;
  if (::bind(fd.get(), endpoint.get(), endpoint.length) != 0) return errno;
  if (::listen(fd.get(), kListenBacklog) != 0) return errno;
  return fd;
}

UniqueFd listen_on(const Endpoint& endpoint, std::uint16_t port, bool port_from_user) {
  std::variant<UniqueFd, int> result = try_listen(endpoint);
  if (auto* fd = std::get_if<UniqueFd>(&result)) return std::move(*fd);
  std::string where = endpoint.with_port(port);
  if (port_from_user) where += " (--master-port)";
  throw LaunchError("cannot listen on " + where + ": " + std::strerror(std::get<int>(result)), 1);
}

std::uint16_t bound_port(int fd) {
  sockaddr_storage sa{};
  socklen_t len = sizeof(sa);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    throw LaunchError(std::string("getsockname on the store socket: ") + std::strerror(errno), 1);
  }
  return sa.ss_family == AF_INET6 ? ntohs(reinterpret_cast<const sockaddr_in6&>(sa).sin6_port)
                                  : ntohs(reinterpret_cast<const sockaddr_in&>(sa).sin_port);
}

// Node 0 of a multi-node job: the store listens on --master-addr's address, so it is reachable
// exactly where the other nodes are told to connect and nowhere else. Without --master-addr, or
// when the address is not one of this host's (a NAT or load-balancer address, or a name that
// other nodes resolve elsewhere), it listens on every interface as torchrun's store does.
UniqueFd listen_for_nodes(const LaunchOptions& options, std::uint16_t port, std::string& warning) {
  const Endpoint any = Endpoint::ipv4(in_addr{htonl(INADDR_ANY)}, port);
  if (!options.master_addr_given) return listen_on(any, port, options.master_port_given);
  const auto all_interfaces = [&](const std::string& why) {
    warning = "--master-addr " + options.master_addr + " " + why +
              "; the store listens on all interfaces";
    return listen_on(any, port, options.master_port_given);
  };
  std::string why;
  const std::vector<Endpoint> endpoints = resolve(options.master_addr, port, why);
  if (endpoints.empty()) return all_interfaces("does not resolve here (" + why + ")");
  // "localhost" means what it says (several "nodes" on one host), as a numeric address does.
  const bool numeric = parse_ipv4(options.master_addr).has_value() ||
                       options.master_addr.find(':') != std::string::npos ||
                       options.master_addr == "localhost";
  for (const Endpoint& endpoint : endpoints) {
    // Debian maps the host's own name to 127.0.1.1: other nodes resolve it to a real address.
    if (!numeric && endpoint.is_loopback()) {
      return all_interfaces("resolves to loopback (" + endpoint.address() + ") here");
    }
    std::variant<UniqueFd, int> result = try_listen(endpoint);
    if (auto* fd = std::get_if<UniqueFd>(&result)) return std::move(*fd);
    if (std::get<int>(result) != EADDRNOTAVAIL) {
      std::string where = endpoint.with_port(port);
      if (options.master_port_given) where += " (--master-port)";
      throw LaunchError("cannot listen on " + where + ": " + std::strerror(std::get<int>(result)),
                        1);
    }
  }
  return all_interfaces("is not an address of this host");
}

}  // namespace

Rendezvous open_rendezvous(const LaunchOptions& options) {
  Rendezvous rdzv;
  const auto port = static_cast<std::uint16_t>(options.master_port);
  if (options.nnodes == 1) {
    // A single-node job never needs to be reachable from elsewhere: keep the store on loopback.
    in_addr bind_addr{};
    bind_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (const std::optional<in_addr> given = parse_ipv4(options.master_addr);
        given && is_loopback(*given)) {
      bind_addr = *given;
    } else if (options.master_addr_given && options.master_addr != "localhost") {
      rdzv.warning = "single-node job: ignoring --master-addr " + options.master_addr +
                     "; the store listens on 127.0.0.1 only";
    }
    rdzv.listen_fd = listen_on(Endpoint::ipv4(bind_addr, port), port, options.master_port_given);
    rdzv.master_addr = Endpoint::ipv4(bind_addr, port).address();
    rdzv.master_port = bound_port(rdzv.listen_fd.get());
    return rdzv;
  }
  rdzv.master_addr = options.master_addr;
  rdzv.master_port = port;
  if (options.node_rank == 0) rdzv.listen_fd = listen_for_nodes(options, port, rdzv.warning);
  return rdzv;
}

}  // namespace mdist::launcher
