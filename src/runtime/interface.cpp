// Finds the local address and interface that reach a given host (for Gloo's device).
#include "src/runtime/interface.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

namespace mdist::detail {
namespace {

// The numeric text of an IPv4 or IPv6 socket address, without port or scope.
std::string numeric_address(const sockaddr* addr) {
  char text[INET6_ADDRSTRLEN] = {};
  const void* const raw =
      addr->sa_family == AF_INET6
          ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr)
          : static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(addr)->sin_addr);
  if (::inet_ntop(addr->sa_family, raw, text, sizeof(text)) == nullptr) return {};
  return text;
}

struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::string interface_holding(const std::string& address) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  const std::unique_ptr<ifaddrs, decltype(&::freeifaddrs)> owner(list, &::freeifaddrs);
  for (const ifaddrs* entry = list; entry != nullptr; entry = entry->ifa_next) {
    if (entry->ifa_addr == nullptr) continue;
    const int family = entry->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    if (numeric_address(entry->ifa_addr) == address) return entry->ifa_name;
  }
  return {};
}

std::optional<LocalRoute> route_toward(const std::string& host, int port, std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    why = "cannot resolve " + host + ": " + ::gai_strerror(rc);
    return std::nullopt;
  }
  const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owner(found, &::freeaddrinfo);
  why = "no route to " + host;
  for (const addrinfo* candidate = found; candidate != nullptr; candidate = candidate->ai_next) {
    const FdCloser sock{::socket(candidate->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0)};
    if (sock.fd < 0) continue;
    if (::connect(sock.fd, candidate->ai_addr, candidate->ai_addrlen) != 0) {
      why = "no route to " + host + ": " + std::strerror(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (::getsockname(sock.fd, reinterpret_cast<sockaddr*>(&local), &length) != 0) continue;
    LocalRoute route;
    route.address = numeric_address(reinterpret_cast<const sockaddr*>(&local));
    if (route.address.empty()) continue;
    route.interface = interface_holding(route.address);
    route.link_local =
        local.ss_family == AF_INET6 &&
        IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6&>(local).sin6_addr);
    return route;
  }
  return std::nullopt;
}

}  // namespace mdist::detail
