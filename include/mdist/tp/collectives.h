#pragma once
// Layer 5b: the tensor-parallel collectives, each an autograd function with the backward that
// makes a split layer compute the unsplit layer's gradients (Megatron's f, g and their
// gather/scatter kin). They run on the group's c10d process group: Gloo on CPU tensors, NCCL on
// CUDA tensors. Every member of the group must call them in the same order (as any collective).
// A group of one rank makes each of them an identity (no communication).
#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>

#include "mdist/runtime/group.h"

namespace mdist::tp {

// Bytes put into the collectives below (the tensor sizes each rank contributes), per handle
// (a TensorParallelPlan, a parallel module), as FSDP counts per unit: for benchmarks comparing
// the traffic with an analytic count, and to tell two models apart. Atomics: backward may run
// on another thread.
struct CommunicationBytes {
  int64_t all_reduce = 0;
  int64_t all_gather = 0;
};
class CommCounters {
 public:
  void add_all_reduce(int64_t bytes) { all_reduce_ += bytes; }
  void add_all_gather(int64_t bytes) { all_gather_ += bytes; }
  CommunicationBytes bytes() const { return {all_reduce_.load(), all_gather_.load()}; }
  void reset() {
    all_reduce_ = 0;
    all_gather_ = 0;
  }

 private:
  std::atomic<int64_t> all_reduce_{0};
  std::atomic<int64_t> all_gather_{0};
};
// Every collective below takes optional counters; null counts nothing.
using Counters = std::shared_ptr<CommCounters>;

// Identity forward; backward all-reduces (sums) the gradient over `group`. Before a
// column-parallel layer: each rank's input gradient is a partial sum over its output columns.
at::Tensor copy_to_group(const at::Tensor& input, const Group& group,
                         const Counters& counters = nullptr);

// Forward all-reduces (sums) over `group`; identity backward. After a row-parallel layer.
at::Tensor reduce_from_group(const at::Tensor& input, const Group& group,
                             const Counters& counters = nullptr);

// Forward concatenates every rank's `input` along `dim` (group-rank order; every rank's input
// must have the same shape); backward gives each rank its own slice of the gradient.
at::Tensor gather_from_group(const at::Tensor& input, const Group& group, int64_t dim,
                             const Counters& counters = nullptr);

// Forward keeps this rank's slice along `dim` (the size must divide by the group size);
// backward all-gathers the gradient.
at::Tensor scatter_to_group(const at::Tensor& input, const Group& group, int64_t dim,
                            const Counters& counters = nullptr);

// Makes `param` (a leaf whose copies live on every member of `group`) receive the sum of the
// members' gradients: for a parameter replicated across a tensor-parallel group whose
// gradient each rank computes only in part (Qwen3's q/k norms over split heads, k/v
// projections replicated across ranks that share a KV head). A gradient hook on the tensor
// itself, so it survives fully_shard (which keeps the module's TensorImpl as the full
// parameter) and fires once per backward with the accumulated gradient.
void sum_gradients_over(const at::Tensor& param, const Group& group,
                        const Counters& counters = nullptr);

// In-place all-reduce of a (contiguous) tensor over `group` without autograd: "sum" or "max".
void all_reduce_(at::Tensor& tensor, const Group& group, const char* op = "sum",
                 const Counters& counters = nullptr);

}  // namespace mdist::tp
