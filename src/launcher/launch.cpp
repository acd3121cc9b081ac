#include "launch.h"

#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "messages.h"
#include "rank_environment.h"
#include "rank_process.h"
#include "rendezvous_socket.h"
#include "signal_watcher.h"
#include "supervisor.h"

namespace mdist::launcher {
namespace {

std::string make_run_id(int nnodes) {
  // Multi-node: every node must agree, and without a rendezvous service there is nothing to
  // agree on, so use torchrun's default --rdzv-id. Single node: a fresh id, like --standalone.
  if (nnodes > 1) return "none";
  std::random_device entropy;
  const std::uint64_t id = (std::uint64_t{entropy()} << 32) | entropy();
  char buffer[17];
  std::snprintf(buffer, sizeof(buffer), "%016llx", static_cast<unsigned long long>(id));
  return buffer;
}

}  // namespace

int launch(const LaunchOptions& options) {
  // Before anything starts: a port conflict must fail the job with no rank running.
  Rendezvous rendezvous = open_rendezvous(options);
  if (!rendezvous.warning.empty()) report(rendezvous.warning);

  // Like torchrun: N ranks each using every core would oversubscribe the machine N times.
  const bool force_omp_threads =
      options.nproc_per_node > 1 && std::getenv("OMP_NUM_THREADS") == nullptr;
  JobLayout layout{
      .nproc_per_node = options.nproc_per_node,
      .nnodes = options.nnodes,
      .node_rank = options.node_rank,
      .master_addr = rendezvous.master_addr,
      .master_port = rendezvous.master_port,
      .run_id = make_run_id(options.nnodes),
      .omp_num_threads = force_omp_threads ? std::optional<std::string>("1") : std::nullopt,
      .stdout_is_tty = isatty(STDOUT_FILENO) == 1,
      .restart_count = 0,
      .max_restarts = options.max_restarts,
  };

  // Blocked before the first fork so no SIGCHLD or Ctrl-C can slip by unnoticed.
  SignalWatcher signals;
  // Orphaned descendants (e.g. a rank's subprocess that called setsid) become our children
  // instead of init's, so the supervisor can kill and reap them before we exit.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);

  const std::vector<std::string> base_env = current_environment();
  const auto kill_timeout = std::chrono::milliseconds(
      static_cast<std::chrono::milliseconds::rep>(std::llround(options.kill_timeout_s * 1000.0)));
  for (;; ++layout.restart_count) {
    std::vector<RankProcess> ranks;  // if a spawn throws, their destructors kill what started
    ranks.reserve(static_cast<std::size_t>(options.nproc_per_node));
    for (int local_rank = 0; local_rank < options.nproc_per_node; ++local_rank) {
      const int global_rank = layout.global_rank(local_rank);
      // The store socket goes to global rank 0 only (it becomes the TCPStore master).
      const bool gets_socket = global_rank == 0 && rendezvous.listen_fd.valid();
      const std::optional<int> listen_fd =
          gets_socket ? std::optional<int>(rendezvous.listen_fd.get()) : std::nullopt;
      const SpawnSpec spec{
          .global_rank = global_rank,
          .argv = options.command,
          .env = build_rank_environment(layout, local_rank, base_env, listen_fd),
          .inherited_fd = listen_fd.value_or(-1),
          .signal_mask = &signals.original_mask(),
      };
      ranks.push_back(spawn_rank(spec));
    }
    // Rank 0 holds the socket now; our copy would only keep the port alive after rank 0
    // exits. With restarts left it is kept: the next attempt's rank 0 listens on it again.
    if (layout.restart_count >= options.max_restarts) rendezvous.listen_fd.reset();
    if (layout.restart_count == 0) {
      // Only now, so that a job that cannot start reports nothing but its one error line.
      if (force_omp_threads) {
        report(
            "OMP_NUM_THREADS is not set; setting it to 1 for every rank to avoid "
            "oversubscribing the CPU (set it yourself to tune)");
      }
      // More ranks than cores run, but slowly and with collectives timing out under load.
      if (const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
          cores > 0 && options.nproc_per_node > cores) {
        report("warning: --nproc-per-node " + std::to_string(options.nproc_per_node) +
               " exceeds this node's " + std::to_string(cores) +
               " CPU cores; the ranks share them (oversubscribed)");
      }
    }
    Supervisor supervisor(std::move(ranks), signals, kill_timeout);
    const int code = supervisor.run();
    if (code == 0 || supervisor.interrupted() || layout.restart_count >= options.max_restarts) {
      if (code != 0 && options.max_restarts > 0 && !supervisor.interrupted()) {
        report("giving up after " + std::to_string(options.max_restarts) + " restart(s)");
      }
      return code;
    }
    report("restarting every rank (restart " + std::to_string(layout.restart_count + 1) + " of " +
           std::to_string(options.max_restarts) +
           ", TORCHELASTIC_RESTART_COUNT=" + std::to_string(layout.restart_count + 1) + ")");
  }
}

}  // namespace mdist::launcher
