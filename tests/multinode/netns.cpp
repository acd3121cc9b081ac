#include "tests/multinode/netns.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "tests/support/subprocess.h"

namespace mdist::testing {
namespace {

namespace fs = std::filesystem;

constexpr const char* kPrefix = "mdist-mn-";

const std::string& ip_binary() {
  static const std::string path = [] {
    for (const char* candidate : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
      if (::access(candidate, X_OK) == 0) return std::string(candidate);
    }
    return std::string();
  }();
  return path;
}

// Runs `ip ARGS...`; empty on success, else what went wrong.
std::string ip(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {ip_binary()};
  argv.insert(argv.end(), args.begin(), args.end());
  RunOptions options;
  options.timeout = std::chrono::seconds(30);
  const RunResult r = run(argv, options);
  if (r.exit_code == 0) return {};
  std::string command = "ip";
  for (const auto& a : args) command += " " + a;
  return "'" + command + "' failed (exit " + std::to_string(r.exit_code) + "): " + r.err;
}

std::vector<pid_t> pids_in(const std::string& netns) {
  std::vector<pid_t> pids;
  RunOptions options;
  options.timeout = std::chrono::seconds(30);
  const RunResult r = run({ip_binary(), "netns", "pids", netns}, options);
  std::istringstream in(r.out);
  for (pid_t pid = 0; in >> pid;) pids.push_back(pid);
  return pids;
}

void kill_everything_in(const std::string& netns) {
  for (int round = 0; round < 100; ++round) {
    const std::vector<pid_t> pids = pids_in(netns);
    if (pids.empty()) return;
    for (const pid_t pid : pids) ::kill(pid, SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// Where `ip netns exec` finds the files it mounts over /etc for that namespace.
fs::path etc_of(const std::string& netns) { return fs::path("/etc/netns") / netns; }

void remove_netns(const std::string& netns) {
  kill_everything_in(netns);
  (void)ip({"netns", "delete", netns});
  std::error_code ignored;
  fs::remove_all(etc_of(netns), ignored);
}

// Namespaces named after a test process that no longer exists (killed by a timeout, so no
// destructor ran) are removed, so they cannot pile up.
void remove_stale() {
  const fs::path dir = "/run/netns";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  std::vector<std::string> stale;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename();
    if (!name.starts_with(kPrefix)) continue;
    const pid_t owner = static_cast<pid_t>(std::atol(name.c_str() + std::string(kPrefix).size()));
    if (owner > 0 && ::kill(owner, 0) != 0 && errno == ESRCH) stale.push_back(name);
  }
  for (const auto& name : stale) remove_netns(name);
}

}  // namespace

std::unique_ptr<NetnsPair> NetnsPair::create(std::string& why) {
  if (::geteuid() != 0) {
    why =
        "network namespaces need root (this test runs as uid " + std::to_string(::geteuid()) + ")";
    return nullptr;
  }
  if (ip_binary().empty()) {
    why = "no 'ip' binary (install iproute2)";
    return nullptr;
  }
  remove_stale();
  static std::atomic<int> counter{0};
  const std::string id = std::to_string(::getpid()) + "-" + std::to_string(counter++);
  std::unique_ptr<NetnsPair> pair(new NetnsPair());
  // Interface names have at most 15 characters: "mn" + pid (<= 7 digits) + "x" + n + "a".
  const std::string short_id = std::to_string(::getpid()) + "x" + std::to_string(counter - 1);
  for (const char side : {'a', 'b'}) {
    pair->names_.push_back(kPrefix + id + "-" + side);
    pair->interfaces_.push_back("mn" + short_id + side);
  }
  std::vector<std::vector<std::string>> steps;
  for (int node = 0; node < 2; ++node) steps.push_back({"netns", "add", pair->name(node)});
  steps.push_back(
      {"link", "add", pair->interface(0), "type", "veth", "peer", "name", pair->interface(1)});
  for (int node = 0; node < 2; ++node) {
    const std::string& ns = pair->name(node);
    const std::string& dev = pair->interface(node);
    steps.push_back({"link", "set", dev, "netns", ns});
    steps.push_back({"-n", ns, "addr", "add", std::string(kAddress[node]) + "/24", "dev", dev});
    // nodad: usable at once, not "tentative" for the second duplicate address detection takes.
    steps.push_back(
        {"-n", ns, "addr", "add", std::string(kAddress6[node]) + "/64", "dev", dev, "nodad"});
    steps.push_back({"-n", ns, "link", "set", dev, "up"});
    steps.push_back({"-n", ns, "link", "set", "lo", "up"});
  }
  for (const auto& step : steps) {
    if (std::string error = ip(step); !error.empty()) {
      why = "cannot make network namespaces: " + error;
      // Anything half made is removed by the destructor; a veth end still outside the
      // namespaces goes with its peer.
      (void)ip({"link", "delete", pair->interface(0)});
      return nullptr;
    }
  }
  // This host's own /etc/hosts (so its own name resolves as before), plus the node names.
  std::ostringstream hosts;
  hosts << std::ifstream("/etc/hosts").rdbuf() << "\n";
  for (int node = 0; node < 2; ++node) hosts << kAddress[node] << " " << kHostName[node] << "\n";
  for (int node = 0; node < 2; ++node) {
    std::error_code ec;
    fs::create_directories(etc_of(pair->name(node)), ec);
    std::ofstream out(etc_of(pair->name(node)) / "hosts");
    out << hosts.str();
    if (ec || !out.flush()) {
      why = "cannot write " + (etc_of(pair->name(node)) / "hosts").string();
      return nullptr;
    }
  }
  return pair;
}

NetnsPair::~NetnsPair() {
  for (const auto& name : names_) remove_netns(name);
}

std::vector<std::string> NetnsPair::inside(int node, const std::vector<std::string>& argv) const {
  std::vector<std::string> full = {ip_binary(), "netns", "exec", name(node)};
  full.insert(full.end(), argv.begin(), argv.end());
  return full;
}

std::vector<pid_t> NetnsPair::pids(int node) const { return pids_in(name(node)); }

void NetnsPair::kill_all(int node) const { kill_everything_in(name(node)); }

}  // namespace mdist::testing
