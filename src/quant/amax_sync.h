#pragma once
// Private: modelopt's `sync_amax_across_distributed_group` (an in-place MAX all-reduce of each
// quantizer's `_amax`) for a list of quantizers at once: one all-gather of what each rank
// holds, one all-reduce of every amax packed into one fp32 buffer.
#include <c10/core/Device.h>

#include <string>
#include <vector>

#include "mdist/groups/distributed_process_group.h"
#include "mdist/quant/tensor_quantizer.h"

namespace mdist::quant::detail {

// A quantizer to sync, by name; every rank of the group passes the same names in the same
// order.
struct AmaxToSync {
  std::string name;
  TensorQuantizer quantizer;
};

// Sets each quantizer's amax to the elementwise max over `group` of the ranks that have one
// (a rank without one counts as zeros: amax is never negative). A quantizer no rank has an
// amax for is left without. Nothing happens for a group that is not initialized (one process,
// or "not used"), as in modelopt. Throws Error when two ranks hold amaxes of different shapes
// or dtypes for one name. The buffer lives on `device` (the backend's device).
void sync_amax_max(const std::vector<AmaxToSync>& quantizers, const DistributedProcessGroup& group,
                   c10::Device device);

}  // namespace mdist::quant::detail
