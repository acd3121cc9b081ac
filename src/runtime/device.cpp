// The compute-device policy: cuda:LOCAL_RANK, one device per rank, or the CPU.
#include "mdist/runtime/device.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>

#include <string>

#include "mdist/error.h"
#include "mdist/runtime/runtime.h"

namespace mdist {

c10::Device select_compute_device(const DeviceQuery& query) {
  if (query.cuda_device_count <= 0) return c10::Device(c10::kCPU);
  if (query.cuda_device_count == 1) return c10::Device(c10::kCUDA, 0);
  if (query.local_rank >= 0 && query.local_rank < query.cuda_device_count) {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(query.local_rank));
  }
  throw Error("mdist: LOCAL_RANK " + std::to_string(query.local_rank) +
              " has no CUDA device of its own: this node shows " +
              std::to_string(query.cuda_device_count) + " CUDA device(s) to " +
              std::to_string(query.local_size) +
              " local ranks; start at most one rank per device, or give each rank its own "
              "device with CUDA_VISIBLE_DEVICES");
}

c10::Device compute_device() {
  return select_compute_device({.cuda_device_count = detail::cuda_device_count(),
                                .local_rank = local_rank(),
                                .local_size = local_size()});
}

namespace detail {

int cuda_device_count() { return static_cast<int>(torch::cuda::device_count()); }

void make_current(const c10::Device& device) {
  if (!device.is_cuda()) return;
  // Through the device-guard registry, so that this file needs no CUDA headers: the CPU-only
  // build never gets here (it sees no CUDA devices).
  c10::impl::VirtualGuardImpl(c10::kCUDA).setDevice(device);
}

}  // namespace detail
}  // namespace mdist
