#include "mdist/runtime/environment.h"

#include <charconv>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "mdist/error.h"

namespace mdist {
namespace {

// Strict decimal parse: the whole string, no sign games, no overflow.
std::optional<long long> parse_integer(std::string_view text) {
  long long value = 0;
  const char* const end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end) return std::nullopt;
  return value;
}

class Reader {
 public:
  explicit Reader(const EnvLookup& lookup) : lookup_(lookup) {}

  std::optional<std::string> get(const std::string& name) const { return lookup_(name); }
  bool has(const std::string& name) const { return lookup_(name).has_value(); }

  // An integer variable within [min, max]; `what` explains the expectation in the error.
  std::optional<int> integer(const std::string& name, long long min, long long max,
                             std::string_view what) const {
    const auto text = lookup_(name);
    if (!text) return std::nullopt;
    const auto value = parse_integer(*text);
    if (!value || *value < min || *value > max) {
      throw EnvironmentError("mdist: invalid " + name + "='" + *text + "': expected " +
                             std::string(what));
    }
    return static_cast<int>(*value);
  }

  int required_integer(const std::string& name, long long min, long long max, std::string_view what,
                       std::string_view context) const {
    const auto value = integer(name, min, max, what);
    if (!value) {
      throw EnvironmentError("mdist: " + std::string(context) + " but " + name + " is not set");
    }
    return *value;
  }

 private:
  const EnvLookup& lookup_;
};

constexpr long long kMaxInt = 1LL << 30;

// Slurm's SLURM_TASKS_PER_NODE is like "4(x2),3": 4 tasks on each of two nodes, then 3.
std::optional<int> slurm_tasks_on_node(const std::string& spec, int node_id) {
  int node = 0;
  std::string_view rest = spec;
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    const std::string_view entry = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    const auto paren = entry.find("(x");
    const auto tasks = parse_integer(entry.substr(0, paren));
    long long repeat = 1;
    if (paren != std::string_view::npos) {
      if (entry.back() != ')') return std::nullopt;
      const auto count = parse_integer(entry.substr(paren + 2, entry.size() - paren - 3));
      if (!count) return std::nullopt;
      repeat = *count;
    }
    if (!tasks) return std::nullopt;
    if (node_id < node + repeat) return static_cast<int>(*tasks);
    node += static_cast<int>(repeat);
  }
  return std::nullopt;
}

void check_ranks(const LaunchEnv& env, const std::string& rank_var, const std::string& size_var,
                 const std::string& local_rank_var, const std::string& local_size_var) {
  if (env.rank >= env.world_size) {
    throw EnvironmentError("mdist: " + rank_var + "=" + std::to_string(env.rank) +
                           " is out of range for " + size_var + "=" +
                           std::to_string(env.world_size) + " (ranks are 0.." +
                           std::to_string(env.world_size - 1) + ")");
  }
  if (env.local_world_size > env.world_size) {
    throw EnvironmentError("mdist: " + local_size_var + "=" + std::to_string(env.local_world_size) +
                           " exceeds " + size_var + "=" + std::to_string(env.world_size));
  }
  if (env.local_rank >= env.local_world_size) {
    throw EnvironmentError("mdist: " + local_rank_var + "=" + std::to_string(env.local_rank) +
                           " is out of range for " + local_size_var + "=" +
                           std::to_string(env.local_world_size));
  }
}

void read_master(const Reader& env_vars, LaunchEnv& env, bool required,
                 const std::optional<std::string>& master_addr,
                 const std::optional<int>& master_port, std::string_view context) {
  if (master_addr) {
    env.master_addr = *master_addr;
  } else if (const auto addr = env_vars.get("MASTER_ADDR"); addr && !addr->empty()) {
    env.master_addr = *addr;
  } else if (required) {
    throw EnvironmentError("mdist: " + std::string(context) + " but MASTER_ADDR is not set");
  } else {
    throw EnvironmentError("mdist: " + std::string(context) +
                           " but no master address: set MASTER_ADDR or pass "
                           "SetupOptions::master_addr");
  }
  if (master_port) {
    if (*master_port < 1 || *master_port > 65535) {
      throw EnvironmentError("mdist: invalid master port " + std::to_string(*master_port) +
                             ": expected 1..65535");
    }
    env.master_port = *master_port;
  } else if (const auto port = env_vars.integer("MASTER_PORT", 1, 65535, "a port in 1..65535")) {
    env.master_port = *port;
  } else if (required) {
    throw EnvironmentError("mdist: " + std::string(context) + " but MASTER_PORT is not set");
  }
  if (const auto fd =
          env_vars.integer("MDIST_STORE_LISTEN_FD", 0, kMaxInt, "an open file descriptor number");
      fd && env.rank == 0) {
    env.store_listen_fd = *fd;
  }
}

}  // namespace

std::string to_string(LaunchSource source) {
  switch (source) {
    case LaunchSource::kTorchrun:
      return "torchrun";
    case LaunchSource::kOpenMPI:
      return "Open MPI";
    case LaunchSource::kPMI:
      return "PMI";
    case LaunchSource::kSlurm:
      return "Slurm";
  }
  return "unknown";
}

std::optional<std::string> process_env(const std::string& name) {
  const char* const value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

std::optional<LaunchEnv> detect_launch_env(const EnvLookup& lookup,
                                           const std::optional<std::string>& master_addr,
                                           const std::optional<int>& master_port) {
  const Reader vars(lookup);
  LaunchEnv env;
  constexpr std::string_view kPositive = "a positive integer";
  constexpr std::string_view kIndex = "a non-negative integer";

  if (vars.has("RANK") || vars.has("WORLD_SIZE")) {
    env.source = LaunchSource::kTorchrun;
    const std::string context = "launched with torchrun-style variables";
    env.world_size = vars.required_integer("WORLD_SIZE", 1, kMaxInt, kPositive, context);
    env.rank = vars.required_integer("RANK", 0, kMaxInt, kIndex, context);
    env.local_rank = vars.integer("LOCAL_RANK", 0, kMaxInt, kIndex).value_or(env.rank);
    env.local_world_size =
        vars.integer("LOCAL_WORLD_SIZE", 1, kMaxInt, kPositive).value_or(env.world_size);
    check_ranks(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
    read_master(vars, env, /*required=*/!master_addr, master_addr, master_port, context);
    return env;
  }
  if (vars.has("OMPI_COMM_WORLD_RANK")) {
    env.source = LaunchSource::kOpenMPI;
    const std::string context = "launched by Open MPI";
    env.world_size = vars.required_integer("OMPI_COMM_WORLD_SIZE", 1, kMaxInt, kPositive, context);
    env.rank = vars.required_integer("OMPI_COMM_WORLD_RANK", 0, kMaxInt, kIndex, context);
    env.local_rank = vars.integer("OMPI_COMM_WORLD_LOCAL_RANK", 0, kMaxInt, kIndex).value_or(0);
    env.local_world_size =
        vars.integer("OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxInt, kPositive).value_or(1);
    check_ranks(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE");
    read_master(vars, env, false, master_addr, master_port, context);
    return env;
  }
  if (vars.has("PMI_RANK")) {
    env.source = LaunchSource::kPMI;
    const std::string context = "launched by a PMI launcher";
    env.world_size = vars.required_integer("PMI_SIZE", 1, kMaxInt, kPositive, context);
    env.rank = vars.required_integer("PMI_RANK", 0, kMaxInt, kIndex, context);
    env.local_rank = vars.integer("MPI_LOCALRANKID", 0, kMaxInt, kIndex).value_or(0);
    env.local_world_size = vars.integer("MPI_LOCALNRANKS", 1, kMaxInt, kPositive).value_or(1);
    check_ranks(env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS");
    read_master(vars, env, false, master_addr, master_port, context);
    return env;
  }
  if (vars.has("SLURM_PROCID")) {
    env.source = LaunchSource::kSlurm;
    const std::string context = "launched by Slurm";
    env.world_size = vars.required_integer("SLURM_NTASKS", 1, kMaxInt, kPositive, context);
    env.rank = vars.required_integer("SLURM_PROCID", 0, kMaxInt, kIndex, context);
    env.local_rank = vars.integer("SLURM_LOCALID", 0, kMaxInt, kIndex).value_or(0);
    const int node_id = vars.integer("SLURM_NODEID", 0, kMaxInt, kIndex).value_or(0);
    env.local_world_size = 1;
    if (const auto spec = vars.get("SLURM_TASKS_PER_NODE")) {
      const auto tasks = slurm_tasks_on_node(*spec, node_id);
      if (!tasks || *tasks < 1) {
        throw EnvironmentError("mdist: invalid SLURM_TASKS_PER_NODE='" + *spec +
                               "' for SLURM_NODEID=" + std::to_string(node_id));
      }
      env.local_world_size = *tasks;
    }
    check_ranks(env, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE");
    read_master(vars, env, false, master_addr, master_port, context);
    return env;
  }
  return std::nullopt;
}

}  // namespace mdist
