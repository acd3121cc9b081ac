#include "rank_environment.h"

#include <algorithm>
#include <string_view>
#include <utility>

extern char** environ;  // NOLINT: POSIX global

namespace mdist::launcher {
namespace {

std::string_view key_of(std::string_view entry) { return entry.substr(0, entry.find('=')); }

}  // namespace

std::vector<std::string> build_rank_environment(const JobLayout& layout, int local_rank,
                                                std::span<const std::string> base,
                                                std::optional<int> store_listen_fd) {
  const int rank = layout.global_rank(local_rank);
  const std::string world_size = std::to_string(layout.world_size());
  std::vector<std::pair<std::string_view, std::string>> vars = {
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"WORLD_SIZE", world_size},
      {"LOCAL_WORLD_SIZE", std::to_string(layout.nproc_per_node)},
      {"GROUP_RANK", std::to_string(layout.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(layout.nnodes)},
      // One role ("default") covering every rank, as torchrun does without --role.
      {"ROLE_RANK", std::to_string(rank)},
      {"ROLE_WORLD_SIZE", world_size},
      {"ROLE_NAME", "default"},
      {"MASTER_ADDR", layout.master_addr},
      {"MASTER_PORT", std::to_string(layout.master_port)},
      // Which attempt this is (0 for the first), as torchrun tells its workers.
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(layout.restart_count)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(layout.max_restarts)},
      {"TORCHELASTIC_RUN_ID", layout.run_id},
      {"MDIST_STDOUT_IS_TTY", layout.stdout_is_tty ? "1" : "0"},
  };
  if (layout.omp_num_threads) vars.emplace_back("OMP_NUM_THREADS", *layout.omp_num_threads);
  if (store_listen_fd) vars.emplace_back(kStoreListenFdVar, std::to_string(*store_listen_fd));

  const auto overridden = [&](std::string_view key) {
    return key == kStoreListenFdVar ||
           std::ranges::any_of(vars, [&](const auto& var) { return var.first == key; });
  };
  std::vector<std::string> env;
  env.reserve(base.size() + vars.size());
  for (const std::string& entry : base) {
    if (!overridden(key_of(entry))) env.push_back(entry);
  }
  for (const auto& [key, value] : vars) env.push_back(std::string(key) + "=" + value);
  return env;
}

std::vector<std::string> current_environment() {
  std::vector<std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    env.emplace_back(*entry);
  }
  return env;
}

}  // namespace mdist::launcher
