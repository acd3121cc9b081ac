// Run by multinode_test on every rank of a job spread over network namespaces: checks what
// the spec's API reports (rank, size, local rank and size) against the launcher's variables,
// and that collectives over the world and over a per-node subgroup give the right values.
// Prints one "ok ..." line and exits 0, or names the first mismatch and exits 1.
#include <cstdlib>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include "mdist/mdist.h"

namespace {

int env_int(const char* name) {
  const char* const value = std::getenv(name);
  return value == nullptr ? -1 : std::atoi(value);
}

int probe(int argc, char** argv) {
  mdist::SetupOptions options;
  options.timeout = std::chrono::milliseconds(argc > 1 ? std::atoi(argv[1]) : 60000);
  const mdist::Session session(options);
  const int rank = mdist::rank();
  const int size = mdist::size();
  const int local_size = mdist::local_size();
  const auto fail = [&](const std::string& what) {
    std::cout << "FAIL rank " << rank << ": " << what << std::endl;
    return 1;
  };
  if (rank != env_int("RANK") || size != env_int("WORLD_SIZE")) return fail("rank or size");
  if (mdist::local_rank() != env_int("LOCAL_RANK") || local_size != env_int("LOCAL_WORLD_SIZE")) {
    return fail("local rank or local size");
  }
  if (mdist::allreduce(rank + 1) != size * (size + 1) / 2) return fail("allreduce sum");
  if (mdist::allreduce(rank, "max") != size - 1) return fail("allreduce max");
  std::vector<int> expected(static_cast<std::size_t>(size));
  std::iota(expected.begin(), expected.end(), 0);
  if (mdist::allgather(rank) != expected) return fail("allgather");
  // The last rank lives on the last node: a broadcast that must cross the link.
  const std::string sent = "from rank " + std::to_string(size - 1);
  if (mdist::broadcast(rank == size - 1 ? sent : std::string(), size - 1) != sent) {
    return fail("broadcast");
  }
  // One subgroup per node (torchrun numbers ranks node by node), made collectively by all.
  const int node = rank / local_size;
  mdist::Group own_node;
  for (int n = 0; n < size / local_size; ++n) {
    std::vector<int> ranks(static_cast<std::size_t>(local_size));
    std::iota(ranks.begin(), ranks.end(), n * local_size);
    const mdist::Group group = mdist::new_group(ranks);
    if (n == node) own_node = group;
  }
  if (mdist::allreduce(rank, "sum", own_node) !=
      local_size * node * local_size + local_size * (local_size - 1) / 2) {
    return fail("allreduce over the node's subgroup");
  }
  mdist::barrier();
  std::cout << "ok rank " << rank << " of " << size << " local " << mdist::local_rank() << " of "
            << local_size << " node " << node << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mdist::guarded_main(probe, argc, argv); }
