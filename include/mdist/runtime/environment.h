#pragma once
// How a process learns its place in a job, from the variables a launcher sets.
// Pure parsing, no communication: the runtime (runtime.h) uses it in setup().
#include <functional>
#include <optional>
#include <string>

namespace mdist {

// Which launcher's variables described the job.
enum class LaunchSource { kTorchrun, kOpenMPI, kPMI, kSlurm };

std::string to_string(LaunchSource source);

struct LaunchEnv {
  LaunchSource source = LaunchSource::kTorchrun;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;
  int master_port = 29500;
  // Set by mdistrun for rank 0: an already-bound listening socket for the store.
  std::optional<int> store_listen_fd;
};

// Looks a variable up; empty optional when unset. Tests pass their own table.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
std::optional<std::string> process_env(const std::string& name);

// Reads the job description, trying torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), then Open MPI's (OMPI_COMM_WORLD_*), PMI's
// (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS) and Slurm's (SLURM_PROCID,
// SLURM_NTASKS, SLURM_LOCALID, SLURM_TASKS_PER_NODE). Under MPI, PMI and Slurm the master
// address comes from MASTER_ADDR or `master_addr`, the port from MASTER_PORT, `master_port`
// or 29500. Returns nothing when no launcher variables are present (a plain process).
// Throws EnvironmentError naming the variable on malformed or inconsistent values.
std::optional<LaunchEnv> detect_launch_env(const EnvLookup& lookup = process_env,
                                           const std::optional<std::string>& master_addr = {},
                                           const std::optional<int>& master_port = {});

}  // namespace mdist
