// Latency of syncing one double across ranks: mdist's get_dist_syncd_obj (object codec +
// two all-gathers), next to a raw c10d all-gather of one float (the floor). Run through
// mdistrun; bench/sync_obj_latency.sh runs it beside PyTorch's all_gather_object.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "bench/latency_stats.h"
#include "mdist/mdist.h"
#include "mdist/runtime/c10d.h"

namespace {

int bench(int argc, char** argv) {
  const int calls = argc > 1 ? std::atoi(argv[1]) : 1000;
  const int warmup = 100;
  const mdist::Session session;
  const int world = mdist::size();
  const double mine = 0.25 * mdist::rank();

  const mdist::DistributedProcessGroup dp;
  const auto max_of = [](const std::vector<double>& v) {
    return *std::max_element(v.begin(), v.end());
  };
  double synced = 0;
  const auto sync_samples = mdist::bench::time_calls(warmup, calls, [&] {
    synced = mdist::DistributedProcessGroup::get_dist_syncd_obj(mine, dp, max_of);
  });
  if (synced != 0.25 * (world - 1)) throw mdist::Error("bench: wrong synced value");

  const auto pg = mdist::process_group(mdist::Group::world());
  at::Tensor input = at::full({1}, static_cast<float>(mine));
  at::Tensor output = at::empty({world});
  const auto raw_samples = mdist::bench::time_calls(warmup, calls, [&] {
    mdist::wait(pg->all_gather_single(output, input), mdist::Group::world(), "all_gather_single");
  });

  if (mdist::is_master()) {
    mdist::bench::print_json("mdist", "get_dist_syncd_obj(double)", world, calls,
                             mdist::bench::summarize(sync_samples));
    mdist::bench::print_json("c10d (C++)", "all_gather_single(float[1])", world, calls,
                             mdist::bench::summarize(raw_samples));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mdist::guarded_main(bench, argc, argv); }
