#pragma once
// Two network namespaces joined by a veth pair, standing in for two nodes on one network: node
// 0 has 10.231.0.1/24 and fd00:231::1/64, node 1 10.231.0.2/24 and fd00:231::2/64, each with
// its own loopback, and both resolve the names mdist-node0 and mdist-node1 to the IPv4
// addresses (an /etc/hosts of their own, which `ip netns exec` mounts). The addresses exist
// only inside the namespaces, and the names carry this process's id and a counter, so parallel
// test runs never collide. The destructor kills whatever still runs inside and removes both
// namespaces (and with them the veth pair); namespaces left by a test process that was killed
// are removed by the next one.
#include <sys/types.h>
#include <memory>
#include <string>
#include <vector>

namespace mdist::testing {

class NetnsPair {
 public:
  static constexpr const char* kAddress[2] = {"10.231.0.1", "10.231.0.2"};
  static constexpr const char* kAddress6[2] = {"fd00:231::1", "fd00:231::2"};
  static constexpr const char* kHostName[2] = {"mdist-node0", "mdist-node1"};

  // Nullptr with `why` set when namespaces cannot be made here (not root, no `ip`, ...).
  static std::unique_ptr<NetnsPair> create(std::string& why);
  ~NetnsPair();
  NetnsPair(const NetnsPair&) = delete;
  NetnsPair& operator=(const NetnsPair&) = delete;

  const std::string& name(int node) const { return names_.at(static_cast<std::size_t>(node)); }
  const std::string& interface(int node) const {
    return interfaces_.at(static_cast<std::size_t>(node));
  }
  // `argv` prefixed so that it runs inside node `node`'s namespace.
  std::vector<std::string> inside(int node, const std::vector<std::string>& argv) const;
  // Every process inside node `node`'s namespace.
  std::vector<pid_t> pids(int node) const;
  // SIGKILLs every process inside node `node`'s namespace until none is left.
  void kill_all(int node) const;

 private:
  NetnsPair() = default;
  std::vector<std::string> names_;
  std::vector<std::string> interfaces_;
};

}  // namespace mdist::testing
