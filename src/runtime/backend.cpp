// Builds c10d process groups from a backend spec ("gloo", "nccl", "cpu:gloo,cuda:nccl").
#include <cstdlib>
#include <string_view>
#include <utility>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef MDIST_HAS_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "mdist/error.h"
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

std::shared_ptr<::gloo::transport::Device> gloo_device(RuntimeState& state) {
  if (!state.gloo_device) {
    // GLOO_SOCKET_IFNAME picks the interface as in torch.distributed; a loopback job stays
    // on loopback so nothing listens on other interfaces.
    if (const char* const ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
      state.gloo_device = c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
    } else if (is_loopback(state.env.master_addr)) {
      state.gloo_device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
    } else {
      state.gloo_device = c10d::ProcessGroupGloo::createDefaultDevice();
    }
  }
  return state.gloo_device;
}

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(
    RuntimeState& state, const c10::intrusive_ptr<c10d::Store>& store, int group_rank, int size,
    std::chrono::milliseconds timeout, const std::string& name, c10::Device& object_device) {
  const BackendChoice choice = parse_backend_spec(state.backend_spec);
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, group_rank, size);
  if (choice.cpu_gloo || choice.cuda_gloo) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(gloo_device(state));
    options->threads = 2;
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("gloo/", store), group_rank, size, options);
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
