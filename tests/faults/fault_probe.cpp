// A program that misbehaves on purpose, driven by fault_test: each mode is one fault a user
// can meet (bad environment, missing peer, crashed peer, timeout, destroyed group, abort).
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/mdist.h"

namespace {

using namespace std::chrono_literals;

int probe(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "setup";
  const auto timeout = std::chrono::milliseconds(argc > 2 ? std::atoi(argv[2]) : 20000);
  mdist::SetupOptions options;
  options.timeout = timeout;
  if (mode == "setup") {
    const mdist::Session session(options);
    std::cout << "joined rank " << mdist::rank() << " of " << mdist::size() << " via "
              << mdist::to_string(mdist::launch_env()->source) << " sum "
              << mdist::allreduce(mdist::rank()) << std::endl;
    return 0;
  }
  if (mode == "serve-store") {
    // What torchrun's elastic agent does: serve the job's TCPStore on MASTER_PORT (it then
    // sets TORCHELASTIC_USE_AGENT_STORE=True for the ranks) until the ranks are done.
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<std::uint16_t>(std::atoi(std::getenv("MASTER_PORT")));
    store_options.isServer = true;
    store_options.waitWorkers = false;
    store_options.timeout = timeout;
    c10d::TCPStore store("127.0.0.1", store_options);
    std::cout << "serving" << std::endl;
    // Until the test says it is done (mode stop-store), at most the timeout: a fixed sleep made
    // the test wait its whole length.
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!store.check({"test/stop"}) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(50ms);
    }
    return 0;
  }
  if (mode == "stop-store") {
    // The agent's store ends: a client sets the key serve-store polls.
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<std::uint16_t>(std::atoi(std::getenv("MASTER_PORT")));
    store_options.isServer = false;
    store_options.timeout = timeout;
    c10d::TCPStore store("127.0.0.1", store_options);
    store.set("test/stop", std::vector<std::uint8_t>{1});
    return 0;
  }
  if (mode == "setup-twice" || mode == "setup-many") {
    // One job after another in this process on the same port, with no pause between them: a
    // rank must not rendezvous in the store of the job that just ended (its rank 0 may still
    // serve it).
    const int jobs = mode == "setup-many" ? 12 : 2;
    for (int job = 0; job < jobs; ++job) {
      const mdist::Session session(options);
      std::cout << "job " << job << " rank " << mdist::rank() << " sum "
                << mdist::allreduce(mdist::rank() + job) << std::endl;
    }
    return 0;
  }
  if (mode == "exception-in-session") {
    const mdist::Session session(options);
    // Rank 0 fails while its peers wait in cleanup's barrier: the Session must not wait for
    // them (the launcher then ends the job).
    if (mdist::rank() == 0) throw std::runtime_error("boom on rank 0");
    return 0;
  }
  mdist::setup(timeout);
  const int me = mdist::rank();
  if (mode == "collective-timeout") {
    // Rank 1 never joins the collective: rank 0 must fail after the timeout, not hang.
    if (me == 1) std::this_thread::sleep_for(30s);
    mdist::allgather(me);
  } else if (mode == "peer-crash") {
    if (me == 1) std::_Exit(0);  // gone without a word, as a crash would be
    std::this_thread::sleep_for(300ms);
    mdist::allgather(me);
  } else if (mode == "destroyed-group") {
    const mdist::Group all = mdist::new_group(mdist::Group::world().ranks());
    mdist::cleanup();
    mdist::allgather(me, all);
  } else if (mode == "fsdp-after-cleanup") {
    torch::manual_seed(0);
    torch::nn::Linear layer(4, 4);
    auto handle = mdist::fully_shard(*layer);
    mdist::cleanup();
    handle.unshard();  // the all-gather needs the destroyed world group
  } else if (mode == "abort") {
    if (me == 1) mdist::abort(7);
    std::this_thread::sleep_for(30s);
  } else {
    throw std::invalid_argument("fault_probe: unknown mode " + mode);
  }
  mdist::cleanup();
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mdist::guarded_main(probe, argc, argv); }
