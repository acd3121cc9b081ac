#pragma once
// Layer 1: joining a job, the default group, and the spec's module-level functions.
//
// Not initialized (a plain single process) behaves exactly as the spec says: size 1, rank 0,
// no backend, barrier a no-op, object collectives return their input.
#include <chrono>
#include <optional>
#include <string>

#include "mdist/runtime/environment.h"
#include "mdist/runtime/group.h"

namespace mdist {

struct SetupOptions {
  // Rendezvous and collective timeout (the default group and groups made without one).
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  // Backend spec as torch.distributed takes it: "gloo", "nccl", "cpu:gloo,cuda:nccl".
  // Empty: "cpu:gloo,cuda:nccl" when CUDA and NCCL are usable, else "gloo".
  std::string backend;
  // Master address and port for MPI/PMI/Slurm launches, overriding MASTER_ADDR/MASTER_PORT.
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
};

// Joins the job described by the environment (see detect_launch_env): rendezvous through a
// c10d TCPStore on the master, then the default process group. Returns false, and stays not
// initialized, when no launcher variables are set. Throws EnvironmentError on a bad
// environment and CommunicationError when the rendezvous fails or times out.
bool setup(const SetupOptions& options = {});
bool setup(std::chrono::milliseconds timeout);

// Barrier (through the rendezvous store, so that no peer is cut off in the middle of a
// collective), then destroys every group; rank 0, which hosts the store, leaves last. While an
// exception is unwinding the barrier is skipped (peers may never arrive). Safe to call when
// not initialized.
void cleanup();

// Aborts communication and ends the process at once with `exit_code`, without running
// destructors that could wait for peers. For fatal errors in a multi-rank job.
[[noreturn]] void abort(int exit_code = 1);

// Calls setup() on construction and cleanup() on destruction. A failing cleanup is reported
// on stderr (a destructor cannot throw).
class Session {
 public:
  explicit Session(const SetupOptions& options = {}) { setup(options); }
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
};

bool is_available();
// Whether this build of mdist has the NCCL backend (built with MDIST_WITH_CUDA); CUDA devices
// may still be absent at run time (torch::cuda::is_available()).
bool nccl_compiled();
bool is_initialized();
// The backend spec of the default group; empty when not initialized.
std::optional<std::string> backend();
// Size of / this process's rank in `group`; -1 for a group this process is not in, as in
// torch.distributed (so is_master and is_last_process are false there, and barrier returns at
// once). Throws Error for a "not used" group and for a group destroyed by cleanup().
int size(const Group& group = Group::world());
int rank(const Group& group = Group::world());
// Rank on this node (LOCAL_RANK); 0 when not initialized.
int local_rank();
// Number of ranks on this node (LOCAL_WORLD_SIZE); 1 when not initialized.
int local_size();
bool is_master(const Group& group = Group::world());
bool is_last_process(const Group& group = Group::world());
void barrier(const Group& group = Group::world());

// The job as setup() read it; empty when not initialized.
std::optional<LaunchEnv> launch_env();
// The timeout given to setup(); collectives of the world use it.
std::chrono::milliseconds default_timeout();

// Runs `body`; an mdist::Error (or any std::exception) becomes one line on stderr,
// "[rank R] <message>", and exit code 1, instead of an uncaught-exception abort.
int guarded_main(int (*body)(int, char**), int argc, char** argv);

}  // namespace mdist
