// `mdist info`: versions, backends, devices, and this job's ranks and groups.
#include <torch/cuda.h>
#include <torch/version.h>
#include <unistd.h>

#include <iostream>
#include <sstream>

#include "mdist/groups/parallel_state.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"
#include "src/cli/commands.h"
#include "src/cli/job.h"

#ifndef MDIST_VERSION_STRING
#define MDIST_VERSION_STRING "unknown"
#endif

namespace mdist::cli {

int run_info(const InfoOptions& o) {
  const Session session(setup_options(o.timeout_s));
  configure_threads();
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::ostringstream me;
  me << "rank " << rank() << ": local rank " << local_rank() << " of " << local_size() << " on "
     << host << ", pid " << getpid() << ", " << torch::get_num_threads() << " thread(s)";
  agree_on_inputs([&] {
    check_tensor_parallel_size(o.tensor_parallel);
    check_expert_parallel_size(o.expert_parallel, o.tensor_parallel);
  });
  const auto ranks = allgather(me.str());
  const JobLayout job = make_layout(o.tensor_parallel, o.expert_parallel);
  const ParallelState& parallel = job.parallel;
  const ParallelLayout layout = parallel_layout(
      std::max(1, size()),
      {.tensor_parallel = o.tensor_parallel, .expert_model_parallel = o.expert_parallel});
  if (rank() != 0) return 0;
  const bool cuda = torch::cuda::is_available();
  std::cout << "mdist " << MDIST_VERSION_STRING << "\n"
            << "libtorch " << TORCH_VERSION << "\n"
            << "compiler " << __VERSION__ << ", C++ " << __cplusplus << "\n"
            << "backends: gloo (CPU) yes; nccl (CUDA) "
            << (nccl_compiled() ? "compiled in" : "not in this build (-DMDIST_WITH_CUDA=ON)")
            << "\n"
            << "CUDA: "
            << (cuda ? "available, " + std::to_string(torch::cuda::device_count()) + " device(s)"
                     : std::string("no device available"))
            << "\n";
  if (!is_initialized()) {
    std::cout << "job: a single process (no launcher variables; run under mdistrun or torchrun "
                 "for a multi-rank job)\n";
  } else {
    const auto env = launch_env();
    std::cout << "job: " << size() << " rank(s), backend " << backend().value_or("?")
              << ", launched by " << to_string(env->source) << ", master " << env->master_addr
              << ":" << env->master_port << "\n";
  }
  for (const auto& line : ranks) std::cout << "  " << line << "\n";
  std::cout << parallel << std::endl;
  const auto groups = [](const std::vector<std::vector<int>>& list) {
    std::ostringstream out;
    for (std::size_t i = 0; i < list.size(); ++i) {
      out << (i ? " " : "") << "[";
      for (std::size_t j = 0; j < list[i].size(); ++j) out << (j ? "," : "") << list[i][j];
      out << "]";
    }
    return out.str();
  };
  std::cout << "layout: " << describe_layout(job) << "\n"
            << "  tensor-parallel groups: " << groups(layout.tensor_parallel_groups) << "\n"
            << "  data-parallel groups: " << groups(layout.data_parallel_groups) << "\n";
  if (o.expert_parallel > 1) {
    std::cout << "  expert-parallel groups: " << groups(layout.expert_model_parallel_groups) << "\n"
              << "  expert-data-parallel groups: " << groups(layout.expert_data_parallel_groups)
              << "\n";
  }
  std::cout << std::flush;
  return 0;
}

}  // namespace mdist::cli
