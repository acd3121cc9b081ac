// setup/cleanup/abort and the spec's module-level functions.
#include "mdist/runtime/runtime.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <thread>

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#ifdef MDIST_HAS_CUDA
#include <torch/cuda.h>
#endif

#include "mdist/error.h"
#include "mdist/runtime/c10d.h"
#include "mdist/runtime/device.h"
#include "src/runtime/runtime_state.h"

namespace mdist {
namespace detail {

std::optional<RuntimeState>& runtime_state() {
  static std::optional<RuntimeState> state;
  return state;
}

}  // namespace detail

namespace {

using detail::runtime_state;
using detail::RuntimeState;

std::string ms_text(std::chrono::milliseconds timeout) {
  return std::to_string(timeout.count()) + " ms";
}

// While joining, libtorch logs every failed connection attempt with a backtrace; mdist reports
// the outcome in one line instead. A user who sets TORCH_CPP_LOG_LEVEL keeps full control.
class QuietTorchLogs {
 public:
  QuietTorchLogs() : saved_(FLAGS_caffe2_log_level) {
    if (std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr) FLAGS_caffe2_log_level = 3;  // FATAL
  }
  ~QuietTorchLogs() { FLAGS_caffe2_log_level = saved_; }
  QuietTorchLogs(const QuietTorchLogs&) = delete;
  QuietTorchLogs& operator=(const QuietTorchLogs&) = delete;

 private:
  int saved_;
};

// mdistrun hands rank 0 a bound socket once; a second setup() in the same process binds anew.
bool launcher_socket_used = false;

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

// An IPv6 master ("::1", "fd00::2", or a name that resolves only to IPv6) needs an
// IPv6 socket; everything else gets the IPv4 one it always had.
bool is_ipv6(const std::string& addr) {
  if (addr.find(':') != std::string::npos) return true;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(addr.c_str(), nullptr, &hints, &found) != 0) return false;
  bool v4 = false;
  bool v6 = false;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    v4 = v4 || a->ai_family == AF_INET;
    v6 = v6 || a->ai_family == AF_INET6;
  }
  ::freeaddrinfo(found);
  return v6 && !v4;
}

// Where rank 0's own client reaches the store it hosts: the address its socket is bound to
// (mdistrun binds a multi-node store to --master-addr's address only), or loopback when it
// listens on every interface.
std::string own_store_host(int listen_fd) {
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  if (::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
    return "127.0.0.1";
  }
  char text[INET6_ADDRSTRLEN] = {};
  if (bound.ss_family == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(bound);
    if (IN6_IS_ADDR_UNSPECIFIED(&v6.sin6_addr)) return "::1";
    ::inet_ntop(AF_INET6, &v6.sin6_addr, text, sizeof(text));
    return text;
  }
  const auto& v4 = reinterpret_cast<const sockaddr_in&>(bound);
  if (v4.sin_addr.s_addr == htonl(INADDR_ANY)) return "127.0.0.1";
  ::inet_ntop(AF_INET, &v4.sin_addr, text, sizeof(text));
  return text;
}

// Rank 0 binds the store's socket itself (unless mdistrun already did), so that a port in
// use is one clear error and a loopback job listens on loopback only.
int bind_store_socket(const std::string& master_addr, int port) {
  const bool v6 = is_ipv6(master_addr);
  const bool loopback = is_loopback(master_addr);
  const int fd = ::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    throw CommunicationError(std::string("mdist: cannot create the store socket: ") +
                             std::strerror(errno));
  }
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int bound = 0;
  if (v6) {
    // Dual-stack when listening on every interface: IPv4 peers can join an IPv6 master too.
    const int zero = 0;
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    sockaddr_in6 addr{};
    addr.sin6_family = AF_INET6;
    addr.sin6_port = htons(static_cast<uint16_t>(port));
    addr.sin6_addr = loopback ? in6addr_loopback : in6addr_any;
    bound = ::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  } else {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = loopback ? htonl(INADDR_LOOPBACK) : htonl(INADDR_ANY);
    bound = ::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  }
  if (bound != 0 || ::listen(fd, 1024) != 0) {
    const int err = errno;
    ::close(fd);
    const char* const where =
        loopback ? (v6 ? " (::1): " : " (127.0.0.1): ") : " (all interfaces): ";
    std::string message = "mdist: rank 0 cannot listen on MASTER_PORT " + std::to_string(port) +
                          where + std::strerror(err);
    if (err == EADDRINUSE) message += " (another job or program holds it; pick a free port)";
    throw EnvironmentError(message);
  }
  return fd;
}

// torchrun's elastic agent already serves a TCPStore on its MASTER_ADDR:MASTER_PORT and says so
// with TORCHELASTIC_USE_AGENT_STORE=True; every rank, rank 0 included, is then a client of it
// (torch.distributed's _create_c10d_store makes the same choice, and only for the agent's own
// address and port: a master address or port given in SetupOptions means a store of our own).
bool agent_store_serves(const LaunchEnv& env) {
  const char* use = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  return use != nullptr && std::string(use) == "True" && addr != nullptr && port != nullptr &&
         env.master_addr == addr && std::to_string(env.master_port) == port;
}

// Set by the cleanup barrier in a store whose job has ended (store_barrier below).
constexpr const char* kJobEndedKey = "mdist/cleanup/open";

c10::intrusive_ptr<c10d::Store> open_store(const LaunchEnv& env, c10d::TCPStoreOptions options,
                                           bool hosts, std::chrono::milliseconds timeout) {
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  const QuietTorchLogs quiet;
  try {
    return c10::make_intrusive<c10d::TCPStore>(
        hosts ? own_store_host(*options.masterListenFd) : env.master_addr, options);
  } catch (const std::exception& error) {
    const std::string cause = detail::first_line(error);
    if (hosts) {
      throw CommunicationError("mdist: setup failed after " + ms_text(timeout) +
                               ": rank 0 waited at " + where + " for all " +
                               std::to_string(env.world_size) + " ranks to join (" + cause + ")");
    }
    throw CommunicationError("mdist: setup failed after " + ms_text(timeout) + ": rank " +
                             std::to_string(env.rank) + " could not join the store at " + where +
                             " (" + cause + ")");
  }
}

c10::intrusive_ptr<c10d::Store> connect_store(const LaunchEnv& env,
                                              std::chrono::milliseconds timeout) {
  const bool agent = agent_store_serves(env);
  const bool hosts = env.rank == 0 && !agent;
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(env.master_port);
  options.isServer = hosts;
  options.numWorkers = static_cast<std::size_t>(env.world_size);
  options.waitWorkers = true;  // every client counts itself in, rank 0 waits for them all
  options.timeout = timeout;
  if (hosts) {
    if (env.store_listen_fd && !launcher_socket_used) {
      options.masterListenFd = *env.store_listen_fd;
      launcher_socket_used = true;
    } else {
      options.masterListenFd = bind_store_socket(env.master_addr, env.master_port);
    }
  }
  if (hosts || agent) return open_store(env, options, hosts, timeout);

  // A second job in this process right after cleanup() (or a job started on the port a
  // moment after another ended) can reach the previous job's store: its rank 0 leaves last and
  // may still serve it. That store's job has ended, so it holds the cleanup barrier's key; a
  // new job's store does not. Wait for the new one rather than rendezvous in the old one.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    options.timeout = std::max(left, std::chrono::milliseconds(1));
    try {
      auto store = open_store(env, options, false, timeout);
      const QuietTorchLogs quiet;
      if (!store->check({kJobEndedKey})) return store;
      if (std::chrono::steady_clock::now() >= deadline) {
        throw CommunicationError(
            "mdist: setup failed after " + ms_text(timeout) + ": rank " + std::to_string(env.rank) +
            " found only the store of a job " + "that has ended at " + env.master_addr + ":" +
            std::to_string(env.master_port) + " (is another job's rank 0 still running there?)");
      }
    } catch (const std::exception&) {
      // The ended job's store closing under us ("connection reset") is expected: join the next
      // one. Connecting itself already retries until the timeout, so past it the error stands.
      if (std::chrono::steady_clock::now() >= deadline) throw;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string default_backend_spec() {
#ifdef MDIST_HAS_CUDA
  if (torch::cuda::is_available()) return "cpu:gloo,cuda:nccl";
#endif
  return "gloo";
}

// torchrun's contract: LOCAL_RANK computes on cuda:LOCAL_RANK, made current before NCCL or
// any CUDA allocation. A node with fewer devices than local ranks is an error only for a
// backend that uses CUDA; a CPU job (gloo) may run more ranks than the node has GPUs.
void use_local_device(const LaunchEnv& env, const std::string& backend_spec) {
  const int devices = detail::cuda_device_count();
  if (devices == 0) return;
  try {
    detail::make_current(select_compute_device({.cuda_device_count = devices,
                                                .local_rank = env.local_rank,
                                                .local_size = env.local_world_size}));
  } catch (const Error& error) {
    if (backend_spec.find("nccl") != std::string::npos) throw EnvironmentError(error.what());
  }
}

int checked_rank_in(const Group& group, const char* op) {
  const auto state = detail::resolve(group, op);
  return state ? state->group_rank : 0;
}

}  // namespace

bool nccl_compiled() {
#ifdef MDIST_HAS_CUDA
  return true;
#else
  return false;
#endif
}

bool setup(const SetupOptions& options) {
  if (runtime_state()) {
    throw Error("mdist: setup() called twice; call cleanup() before joining another job");
  }
  if (options.timeout <= std::chrono::milliseconds(0)) {
    throw Error("mdist: setup timeout must be positive, got " + ms_text(options.timeout));
  }
  const auto env = detect_launch_env(process_env, options.master_addr, options.master_port);
  if (!env) return false;

  RuntimeState state;
  state.env = *env;
  state.timeout = options.timeout;
  state.backend_spec = options.backend.empty() ? default_backend_spec() : options.backend;
  use_local_device(*env, state.backend_spec);
  state.store = connect_store(*env, options.timeout);
  if (agent_store_serves(*env)) {
    // The agent's store may outlive a job (a second setup() after cleanup(), another job on the
    // same agent): each job's keys go under its own generation. Every rank of a job counts
    // itself in before any rank of the next one can (the next job starts after this one's
    // cleanup barrier), so (count - 1) / world is the same on all of them.
    const int64_t count = state.store->add("mdist/generations", 1);
    state.store = c10::make_intrusive<c10d::PrefixStore>(
        "mdist/generation-" + std::to_string((count - 1) / env->world_size) + "/", state.store);
  }

  auto world = std::make_shared<detail::GroupState>();
  world->id = 0;
  world->group_rank = env->rank;
  world->timeout = options.timeout;
  for (int r = 0; r < env->world_size; ++r) world->ranks.push_back(r);
  try {
    const QuietTorchLogs quiet;
    world->pg = detail::make_process_group(
        state, c10::make_intrusive<c10d::PrefixStore>("mdist/world/", state.store), env->rank,
        env->world_size, options.timeout, "world", world->object_device);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& error) {
    throw CommunicationError("mdist: setup failed on rank " + std::to_string(env->rank) +
                             " while connecting the " + state.backend_spec + " backend (timeout " +
                             ms_text(options.timeout) + "): " + detail::first_line(error));
  }
  state.world = world;
  state.groups.push_back(world);
  runtime_state() = std::move(state);
  return true;
}

bool setup(std::chrono::milliseconds timeout) {
  SetupOptions options;
  options.timeout = timeout;
  return setup(options);
}

namespace {

// Every rank has reached cleanup: a barrier through the store, not through Gloo. After it no
// collective is in flight anywhere, so tearing the process groups down cannot cut a peer off
// in the middle of one (closing a Gloo pair early resets the peer's connection).
void store_barrier(const RuntimeState& state, const std::string& name) {
  const std::string arrived = "mdist/" + name + "/arrived";
  const std::string open = "mdist/" + name + "/open";  // kJobEndedKey for "cleanup"
  if (state.store->add(arrived, 1) == state.env.world_size)
    state.store->set(open, std::vector<uint8_t>{1});
  state.store->wait({open}, state.timeout);
}

// Rank 0 hosts the store: it leaves last, once every other rank has said it is done with it.
void leave_store(const RuntimeState& state) {
  const std::string left = "mdist/cleanup/left";
  if (state.env.rank != 0) {
    state.store->add(left, 1);
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (state.store->add(left, 0) < state.env.world_size - 1 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

}  // namespace

void cleanup() {
  auto& state = runtime_state();
  if (!state) return;
  // While an exception unwinds, peers may never arrive: leave at once.
  const bool unwinding = std::uncaught_exceptions() > 0;
  std::exception_ptr barrier_error;
  if (!unwinding) {
    try {
      store_barrier(*state, "cleanup");
    } catch (const std::exception& error) {
      barrier_error = std::make_exception_ptr(
          CommunicationError("mdist: cleanup: rank " + std::to_string(state->env.rank) +
                             " could not meet the other ranks (timeout " + ms_text(state->timeout) +
                             "): " + detail::first_line(error)));
    }
  }
  for (const auto& group : state->groups) {
    group->pg.reset();
    group->destroyed = true;
  }
  if (!unwinding && !barrier_error) {
    try {
      const QuietTorchLogs quiet;  // a store already closed by rank 0 is expected here
      leave_store(*state);
    } catch (const std::exception&) {
      // The job is over either way; a store that went away early changes nothing.
    }
  }
  state.reset();
  if (barrier_error) std::rethrow_exception(barrier_error);
}

Session::~Session() {
  try {
    cleanup();
  } catch (const std::exception& error) {
    std::cerr << detail::first_line(error) << std::endl;
  }
}

void abort(int exit_code) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  // No destructors: a process group's would wait for peers that may be gone.
  std::_Exit(exit_code);
}

bool is_available() { return true; }

bool is_initialized() { return runtime_state().has_value(); }

std::optional<std::string> backend() {
  if (!runtime_state()) return std::nullopt;
  return runtime_state()->backend_spec;
}

int size(const Group& group) {
  if (detail::is_outside(group)) return -1;
  const auto state = detail::resolve(group, "size");
  return state ? static_cast<int>(state->ranks.size()) : 1;
}

int rank(const Group& group) {
  if (detail::is_outside(group)) return -1;
  return checked_rank_in(group, "rank");
}

int local_rank() { return runtime_state() ? runtime_state()->env.local_rank : 0; }

int local_size() { return runtime_state() ? runtime_state()->env.local_world_size : 1; }

bool is_master(const Group& group) { return rank(group) == 0; }

bool is_last_process(const Group& group) { return rank(group) == size(group) - 1; }

void barrier(const Group& group) {
  // torch.distributed.barrier returns at once on a rank outside the group.
  if (detail::is_outside(group)) return;
  const auto state = detail::resolve(group, "barrier");
  if (!state) return;
  c10d::BarrierOptions options;
  options.timeout = state->timeout;
  if (state->object_device.is_cuda()) options.device_ids = {state->object_device.index()};
  detail::wait_work(state->pg->barrier(options), *state, "barrier");
}

std::optional<LaunchEnv> launch_env() {
  if (!runtime_state()) return std::nullopt;
  return runtime_state()->env;
}

std::chrono::milliseconds default_timeout() {
  return runtime_state() ? runtime_state()->timeout : SetupOptions{}.timeout;
}

c10::intrusive_ptr<c10d::Store> store() {
  if (!runtime_state()) throw Error("mdist: store() needs an initialized job; call setup() first");
  return runtime_state()->store;
}

int guarded_main(int (*body)(int, char**), int argc, char** argv) {
  try {
    return body(argc, argv);
  } catch (const std::exception& error) {
    std::cerr << detail::first_line(error) << std::endl;
    return 1;
  }
}

}  // namespace mdist
