#pragma once
// Layer 5c: expert parallelism. The routed experts of a mixture-of-experts layer are split over
// an expert-parallel group (E / ep consecutive experts per rank, Megatron's layout); each token
// goes, once per chosen expert, to the rank that owns that expert and comes back combined:
//
//   sort (token, slot) pairs by expert -> all-to-all of per-expert counts -> all-to-all of the
//   hidden rows (to the owners) -> regroup by local expert -> experts -> all-to-all back ->
//   unsort -> weighted sum over the top-k slots.
//
// Both all-to-alls are autograd nodes whose backward is the reverse all-to-all, so gradients
// reach the hidden states on the sending rank and the expert weights on the owning rank. They
// run on the group's c10d process group (all_to_all_single with per-rank split sizes): Gloo on
// CPU tensors, NCCL on CUDA tensors. Every member of the group calls them in the same order.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "mdist/runtime/group.h"

namespace mdist::ep {

// Sends input rows [input_splits[0] rows to group rank 0, the next input_splits[1] to rank 1,
// ...] and returns the rows received, in group-rank order, output_splits[r] of them from rank
// r (which must be what rank r sends here). Rows may have any trailing shape; all ranks' must
// match. Differentiable: the backward sends each row's gradient back the way it came. A group
// of one rank returns the input.
at::Tensor all_to_all(const at::Tensor& input, std::span<const int64_t> input_splits,
                      std::span<const int64_t> output_splits, const Group& group);

// Each rank gives `per_destination` (group size x n counts: n for each destination rank) and
// receives the n counts every rank addressed to it, in group-rank order (group size x n).
std::vector<int64_t> exchange_counts(std::span<const int64_t> per_destination, int64_t n,
                                     const Group& group);

// Which experts a rank owns: [first, first + count) of the layer's num_experts.
struct ExpertRange {
  int64_t first = 0;
  int64_t count = 0;
};
// Throws Error when num_experts does not divide by the group's size (naming both).
ExpertRange owned_experts(int64_t num_experts, const Group& group);

// Runs a local expert on the rows routed to it ([n, hidden] -> [n, hidden]); `local` counts
// from 0 within this rank's ExpertRange. Called once per local expert that received rows, in
// expert order.
using ExpertFn = std::function<at::Tensor(int64_t local, const at::Tensor& rows)>;

// The routed experts' output for `hidden` [tokens, hidden]: sum over k of
// weight[t, k] * expert_{index[t, k]}(hidden[t]), with the experts spread over `group`.
// `index` [tokens, top_k] (int64, in [0, num_experts)) and `weight` [tokens, top_k] come from
// the router on this rank. With a group of one rank every expert is local and nothing is sent.
// Throws Error on shapes that do not match or an expert index out of range.
at::Tensor dispatch_combine(const at::Tensor& hidden, const at::Tensor& index,
                            const at::Tensor& weight, int64_t num_experts, const Group& group,
                            const ExpertFn& expert);

// Bytes this process has sent through all_to_all (rows addressed to other ranks, forward and
// backward), since the start or the last reset: for benchmarks comparing the traffic with the
// analytic count.
int64_t all_to_all_bytes();
void reset_all_to_all_bytes();

}  // namespace mdist::ep
