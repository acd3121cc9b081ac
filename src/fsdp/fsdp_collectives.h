#pragma once
// Private: the communication of a fully_shard unit (FSDP2's _fsdp_collectives): packing the
// shards into one flat buffer, the all-gather and unpacking it into full parameters, the
// reduce-scatter of full gradients into shard gradients, and the all-reduce of replicated
// gradients. One collective per unit and step for each.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <vector>

#include "mdist/runtime/group.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace mdist::detail {

class FsdpParamGroup;
class FsdpParam;

// An all-gather of a unit's shards, issued and perhaps not yet complete.
struct PendingGather {
  c10::intrusive_ptr<c10d::Work> work;  // null when complete (or for one rank)
  at::Tensor input;                     // kept alive until the work is done
  at::Tensor output;                    // [world * flat_numel]
  bool started() const { return output.defined(); }
};

// Issues the all-gather of every rank's shards in `dtype`, on the unit's compute device,
// without waiting (prefetch).
PendingGather start_all_gather(const FsdpParamGroup& unit, c10::ScalarType dtype);
// Waits for it; returns the gathered buffer and leaves `pending` empty.
at::Tensor finish_all_gather(PendingGather& pending, const FsdpParamGroup& unit);

// Copies `param`'s rows out of a gathered buffer into `full` (contiguous, full size), dropping
// the padding.
void unpack_rows(const FsdpParamGroup& unit, const FsdpParam& param, const at::Tensor& gathered,
                 const at::Tensor& full);

// A reduce-scatter of a unit's gradients, issued and perhaps not yet complete.
struct PendingReduce {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor input;   // [world, numel], kept alive until the work is done
  at::Tensor output;  // [numel]: this rank's summed chunk, has-gradient flags first
  std::vector<std::size_t> which;
  std::vector<int64_t> offsets;  // of each which[k]'s rows in a chunk
  bool started() const { return output.defined(); }
};

// Copies the full gradients of unit.params[i] for each i in `which` into one buffer (in the
// unit's reduce dtype) and issues their reduce-scatter without waiting: the full gradients
// may be dropped as soon as this returns. More than one rank only.
PendingReduce start_reduce_scatter(const FsdpParamGroup& unit, std::vector<std::size_t> which);
// Waits for it and averages: element k is this rank's shard of the averaged gradient of
// params[which[k]], or undefined when no rank had a gradient for it. Leaves `pending` empty.
std::vector<at::Tensor> finish_reduce_scatter(PendingReduce& pending, const FsdpParamGroup& unit);
// One rank: the same result at once, from the full gradients themselves (no copy where the
// dtype already is the reduce dtype).
std::vector<at::Tensor> reduce_locally(const FsdpParamGroup& unit,
                                       const std::vector<std::size_t>& which);

// Averages the gradients of whole, replicated parameters over `group` (`world` ranks), one
// all-reduce per dtype and device: element k is the average (ranks without a gradient count
// as zero), or undefined when no rank had one.
std::vector<at::Tensor> all_reduce_gradients(const FsdpParamGroup& unit,
                                             const std::vector<at::Tensor>& params);

}  // namespace mdist::detail
