#include "rendezvous_socket.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <optional>

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

std::string to_string(in_addr addr) {
  char buffer[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &addr, buffer, sizeof(buffer));
  return buffer;
}

UniqueFd listen_on(in_addr addr, std::uint16_t port, bool port_from_user) {
  const auto fail = [&](int error) -> LaunchError {
    std::string where = to_string(addr) + ":" + std::to_string(port);
    if (port_from_user) where += " (--master-port)";
    return LaunchError("cannot listen on " + where + ": " + std::strerror(error), 1);
  };
  // CLOEXEC: only rank 0 may inherit it; the spawner clears the flag in that one child.
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw fail(errno);
  // Lets a new job reuse the port of a previous one whose connections linger in TIME_WAIT.
  const int one = 1;
  if (::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) throw fail(errno);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr = addr;
  sa.sin_port = htons(port);
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) != 0) throw fail(errno);
  if (::listen(fd.get(), kListenBacklog) != 0) throw fail(errno);
  return fd;
}

std::uint16_t bound_port(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    throw LaunchError(std::string("getsockname on the store socket: ") + std::strerror(errno), 1);
  }
  return ntohs(sa.sin_port);
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
    rdzv.listen_fd = listen_on(bind_addr, port, options.master_port_given);
    rdzv.master_addr = to_string(bind_addr);
    rdzv.master_port = bound_port(rdzv.listen_fd.get());
    return rdzv;
  }
  rdzv.master_addr = options.master_addr;
  rdzv.master_port = port;
  if (options.node_rank == 0) {
    // Other nodes reach us through whatever interface MASTER_ADDR names: listen on all of them.
    in_addr any{};
    any.s_addr = htonl(INADDR_ANY);
    rdzv.listen_fd = listen_on(any, port, options.master_port_given);
  }
  return rdzv;
}

}  // namespace mdist::launcher
