// The torchrun environment contract: which variables each rank gets.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace mdist::launcher {

// Everything that is the same for all ranks of this node.
struct JobLayout {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;
  std::uint16_t master_port = 0;
  std::string run_id;
  // Set when OMP_NUM_THREADS is to be forced (torchrun does so for nproc > 1 when unset).
  std::optional<std::string> omp_num_threads;
  // Whether the launcher's own stdout is a terminal. Ranks write into a pipe to the launcher,
  // so they learn it from MDIST_STDOUT_IS_TTY (e.g. to draw a progress bar in place).
  bool stdout_is_tty = false;
  // TORCHELASTIC_RESTART_COUNT / TORCHELASTIC_MAX_RESTARTS.
  int restart_count = 0;
  int max_restarts = 0;

  [[nodiscard]] int world_size() const { return nnodes * nproc_per_node; }
  [[nodiscard]] int global_rank(int local_rank) const {
    return node_rank * nproc_per_node + local_rank;
  }
};

// Name of the variable that tells rank 0 which inherited fd is the store's listening socket.
inline constexpr const char* kStoreListenFdVar = "MDIST_STORE_LISTEN_FD";

// `base` is the launcher's own environment ("KEY=VALUE" entries). Variables of the contract
// found in `base` are replaced, never duplicated; MDIST_STORE_LISTEN_FD is removed unless
// `store_listen_fd` is given (so a stale value cannot leak into non-zero ranks).
[[nodiscard]] std::vector<std::string> build_rank_environment(const JobLayout& layout,
                                                              int local_rank,
                                                              std::span<const std::string> base,
                                                              std::optional<int> store_listen_fd);

// The current process environment as "KEY=VALUE" strings.
[[nodiscard]] std::vector<std::string> current_environment();

}  // namespace mdist::launcher
