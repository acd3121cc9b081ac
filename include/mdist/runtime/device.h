#pragma once
// Layer 1: which device a rank computes on, one policy for the whole library.
//
// torchrun's contract: rank LOCAL_RANK of a node uses cuda:LOCAL_RANK. setup() makes that
// device current (so libtorch's CUDA allocations and NCCL land on it); the job, fsdp2_wrap and
// fully_shard's defaults all ask compute_device().
#include <c10/core/Device.h>

namespace mdist {

// What a process sees when it picks its device.
struct DeviceQuery {
  int cuda_device_count = 0;  // visible CUDA devices
  int local_rank = 0;         // LOCAL_RANK
  int local_size = 1;         // LOCAL_WORLD_SIZE
};

// The CPU without CUDA devices; cuda:local_rank when this node has a device per local rank;
// cuda:0 when exactly one device is visible (one device per rank through
// CUDA_VISIBLE_DEVICES). Fewer devices than that would put ranks on a device that is not
// theirs: an Error naming the local rank and the device count.
c10::Device select_compute_device(const DeviceQuery& query);

// select_compute_device for this process (the job's LOCAL_RANK and LOCAL_WORLD_SIZE, or rank 0
// of 1 when not initialized).
c10::Device compute_device();

namespace detail {
// CUDA devices this process sees (0 in the CPU-only build).
int cuda_device_count();
// Makes `device` the current CUDA device (nothing for the CPU).
void make_current(const c10::Device& device);
}  // namespace detail

}  // namespace mdist
