// Builds c10d process groups from a backend spec ("gloo", "nccl", "cpu:gloo,cuda:nccl").
#include <cstdlib>
#include <stdexcept>
#include <string_view>
#include <utility>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef MDIST_HAS_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "mdist/error.h"
#include "src/runtime/group_state.h"
#include "src/runtime/interface.h"
#include "src/runtime/runtime_state.h"

namespace mdist::detail {
namespace {

struct BackendChoice {
  bool cpu_gloo = false;
  bool cuda_gloo = false;
  bool cuda_nccl = false;
};

BackendChoice parse_backend_spec(const std::string& spec) {
  BackendChoice choice;
  const auto unsupported = [&](std::string_view what) {
    return Error("mdist: unsupported backend '" + std::string(what) + "' in '" + spec +
                 "': mdist supports gloo (CPU) and nccl (CUDA)");
  };
  if (spec == "gloo") {
    choice.cpu_gloo = true;
    return choice;
  }
  if (spec == "nccl") {
    choice.cuda_nccl = true;
    return choice;
  }
  std::string_view rest = spec;
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    const auto colon = item.find(':');
    if (colon == std::string_view::npos) throw unsupported(item);
    const auto device = item.substr(0, colon);
    const auto name = item.substr(colon + 1);
    if (device == "cpu" && name == "gloo") {
      choice.cpu_gloo = true;
    } else if (device == "cuda" && name == "nccl") {
      choice.cuda_nccl = true;
    } else if (device == "cuda" && name == "gloo") {
      choice.cuda_gloo = true;
    } else {
      throw unsupported(item);
    }
  }
  if (!choice.cpu_gloo && !choice.cuda_gloo && !choice.cuda_nccl) throw unsupported(spec);
  return choice;
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

// Gloo's device (the address its pairs listen on and publish to the other ranks), and in
// `state.gloo_endpoint` a description of it for error messages.
std::shared_ptr<::gloo::transport::Device> gloo_device(RuntimeState& state) {
  if (state.gloo_device) return state.gloo_device;
  const std::string& master = state.env.master_addr;
  if (const char* const ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    // As in torch.distributed, an explicit interface always wins.
    state.gloo_endpoint = std::string("interface ") + ifname + " (GLOO_SOCKET_IFNAME)";
    state.gloo_device = c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  } else if (is_loopback(master)) {
    // A loopback job stays on loopback, so nothing listens on other interfaces.
    state.gloo_endpoint = "127.0.0.1 (MASTER_ADDR " + master + " is loopback)";
    state.gloo_device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  } else if (std::string why; const auto route = route_toward(master, state.env.master_port, why)) {
    // The address the kernel routes toward MASTER_ADDR reaches node 0, so in the usual flat
    // cluster network it reaches every other node as well (MASTER_ADDR may be our own address).
    const std::string on = route->interface.empty() ? "" : " on " + route->interface;
    state.gloo_endpoint = route->address + on + " (the route to MASTER_ADDR " + master + ")";
    // A link-local IPv6 address needs its interface to bind; Gloo then takes it from there.
    state.gloo_device = route->link_local && !route->interface.empty()
                            ? c10d::ProcessGroupGloo::createDeviceForInterface(route->interface)
                            : c10d::ProcessGroupGloo::createDeviceForHostname(route->address);
  } else {
    state.gloo_endpoint = "this host's name (" + why + ")";
    state.gloo_device = c10d::ProcessGroupGloo::createDefaultDevice();
  }
  return state.gloo_device;
}

// Gloo's connect errors name neither the local address nor the remedy: add both.
std::runtime_error with_gloo_endpoint(const RuntimeState& state, const std::exception& error) {
  const std::string endpoint = state.gloo_endpoint.empty() ? "an address" : state.gloo_endpoint;
  return std::runtime_error(first_line(error) + "; Gloo used " + endpoint +
                            "; set GLOO_SOCKET_IFNAME to the interface that reaches the other "
                            "nodes if that is the wrong one");
}

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(
    RuntimeState& state, const c10::intrusive_ptr<c10d::Store>& store, int group_rank, int size,
    std::chrono::milliseconds timeout, const std::string& name, c10::Device& object_device) {
  const BackendChoice choice = parse_backend_spec(state.backend_spec);
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, group_rank, size);
  if (choice.cpu_gloo || choice.cuda_gloo) {
    c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
    try {
      auto options = c10d::ProcessGroupGloo::Options::create(timeout);
      options->devices.push_back(gloo_device(state));
      options->threads = 2;
      gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<c10d::PrefixStore>("gloo/", store), group_rank, size, options);
    } catch (const std::exception& error) {
      throw with_gloo_endpoint(state, error);
    }
    if (choice.cpu_gloo) pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::GLOO, gloo);
    if (choice.cuda_gloo) pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::GLOO, gloo);
    pg->setDefaultBackend(c10d::ProcessGroup::GLOO);
  }
  if (choice.cuda_nccl) {
#ifdef MDIST_HAS_CUDA
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::make_intrusive<c10d::PrefixStore>("nccl/", store), group_rank, size, options);
    pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::NCCL, nccl);
    if (!choice.cpu_gloo) pg->setDefaultBackend(c10d::ProcessGroup::NCCL);
#else
    throw Error("mdist: backend '" + state.backend_spec +
                "' needs NCCL, but this mdist build has no CUDA support (configure with "
                "-DMDIST_WITH_CUDA=ON and a CUDA libtorch)");
#endif
  }
  pg->setGroupName(name);
  object_device = c10::Device(c10::kCPU);
#ifdef MDIST_HAS_CUDA
  if (!choice.cpu_gloo) {
    object_device =
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(c10::cuda::current_device()));
  }
#endif
  return pg;
}

}  // namespace mdist::detail
