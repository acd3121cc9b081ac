// A tour of mdist's distributed API: run it with the launcher, e.g.
//   build/bin/mdistrun --nproc-per-node 4 build/bin/mdist-demo
// Each rank joins the job, builds a ParallelState (tensor parallel 2 when the world allows),
// and syncs a per-rank "amax" the way quantization calibration does.
#include <algorithm>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "mdist/mdist.h"

namespace {

int demo(int /*argc*/, char** /*argv*/) {
  mdist::Session session;  // setup() now, cleanup() at the end
  const int world = mdist::size();
  const int me = mdist::rank();
  if (mdist::is_master()) {
    std::cout << "mdist demo: " << world << " rank(s), backend "
              << mdist::backend().value_or("none (single process)") << std::endl;
  }

  const int tp = world % 2 == 0 ? 2 : 1;
  const mdist::ParallelState state = mdist::make_parallel_state({.tensor_parallel = tp});
  std::cout << state << std::endl;

  // Each rank saw a different activation range; everyone needs the global maximum.
  const double local_amax = 0.5 + me;
  const auto max_of = [](const std::vector<double>& values) {
    return *std::max_element(values.begin(), values.end());
  };
  const double amax = mdist::DistributedProcessGroup::get_dist_syncd_obj(
      local_amax, {state.data_parallel_group, state.tensor_parallel_group}, max_of);

  // Objects of any shape travel too: here a per-rank table, gathered everywhere.
  const std::map<std::string, int> table = {{"rank", me}, {"local_rank", mdist::local_rank()}};
  const auto tables = mdist::allgather(table);
  const int rank_sum = mdist::allreduce(me);
  if (mdist::is_master()) {
    std::cout << "synced amax " << amax << " (expected " << 0.5 + world - 1 << "), gathered "
              << tables.size() << " tables, sum of ranks " << rank_sum << std::endl;
  }
  return amax == 0.5 + world - 1 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) { return mdist::guarded_main(demo, argc, argv); }
