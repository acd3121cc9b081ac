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
#include <torch/nn/module.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "mdist/runtime/group.h"

namespace mdist::ep {

// What the all-to-alls of one handle (an ExpertParallel style, or whoever passes them) have
// moved: per handle, as FSDP counts per unit, so that two models (a student and its teacher)
// or two blocks are told apart. Updated from forward and backward (atomics: backward may run on
// another thread).
struct CommStats {
  int64_t all_to_alls = 0;
  int64_t bytes_sent = 0;  // rows addressed to other ranks
};
class CommCounters {
 public:
  void add(int64_t bytes) {
    calls_ += 1;
    bytes_ += bytes;
  }
  CommStats stats() const { return {calls_.load(), bytes_.load()}; }
  void reset() {
    calls_ = 0;
    bytes_ = 0;
  }

 private:
  std::atomic<int64_t> calls_{0};
  std::atomic<int64_t> bytes_{0};
};

// Sends input rows [input_splits[0] rows to group rank 0, the next input_splits[1] to rank 1,
// ...] and returns the rows received, in group-rank order, output_splits[r] of them from rank
// r (which must be what rank r sends here). Rows may have any trailing shape; all ranks' must
// match. Differentiable: the backward sends each row's gradient back the way it came. A group
// of one rank returns the input.
// `counters` (optional) counts this exchange and its backward's.
at::Tensor all_to_all(const at::Tensor& input, std::span<const int64_t> input_splits,
                      std::span<const int64_t> output_splits, const Group& group,
                      const std::shared_ptr<CommCounters>& counters = nullptr);

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

// One dispatch of rows already sorted by expert: how many go to and come from each rank, and
// how the arrivals (grouped by source rank, then by expert) are regrouped by local expert.
struct Dispatch {
  std::vector<int64_t> input_splits;    // rows to each group rank
  std::vector<int64_t> output_splits;   // rows from each group rank
  std::vector<int64_t> rows_per_local;  // arrived rows per local expert, in expert order
  at::Tensor by_expert;                 // arrival positions in local-expert-major order
};
// Collective over `group` (the per-expert counts are exchanged): `per_expert` [num_experts]
// rows of this rank for each expert (the rows to send are sorted by expert).
Dispatch plan_dispatch(std::span<const int64_t> per_expert, int64_t num_experts,
                       const Group& group);
// Sends `sorted` (rows sorted by expert, per_expert of them each) to the experts' owners and
// returns the rows arrived here grouped by local expert (rows_per_local of each).
at::Tensor dispatch(const at::Tensor& sorted, const Dispatch& plan, const Group& group,
                    const std::shared_ptr<CommCounters>& counters = nullptr);
// The reverse of dispatch: `processed` (one output row per arrived row, in dispatch's
// local-expert-major order) back to the ranks the rows came from, in their sorted order.
// `grouped` is dispatch's result: with no row here the (empty) result still hangs off it, so
// that this rank's graph has the same all-to-all nodes as every other rank's.
at::Tensor undispatch(const at::Tensor& processed, const at::Tensor& grouped, const Dispatch& plan,
                      const Group& group, const std::shared_ptr<CommCounters>& counters = nullptr);

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
                            const ExpertFn& expert,
                            const std::shared_ptr<CommCounters>& counters = nullptr);

// torchtitan's ExpertParallel style: installed on a grouped-experts module, whose forward
// takes (rows [M, hidden] sorted by expert, counts [E] int64: rows per expert, tokens [M]
// int64: the token of each row) and returns one output row per input row in the same order,
// computing whichever experts it holds. With the style the module holds only this rank's experts
// (owned_experts) and its forward hooks do the rest around it: the pre-hook sends each row to its
// expert's owner and hands the module the rows arrived here grouped by local expert with their
// local counts; the post-hook sends the outputs back, so that the module's caller sees every row's
// output in its own order, as without expert parallelism. Each expert's rows travel in token order,
// as dispatch_combine sends them (the order in which the expert's weight gradient sums them,
// whatever order the caller sorted them in). The module stays a plain computation with no
// group; the caller (the routing and the weighted combine) does not change either.
// An FSDP unit around the module's caller (hf::shard_experts) runs around the whole exchange.
// Every rank of the group calls the module once per forward, also with no
// row, as the exchanges are collectives.
class ExpertParallel {
 public:
  ExpertParallel(Group group, int64_t num_experts);
  // Registers the hooks on `module` (they live as long as the module).
  void apply(torch::nn::Module& module) const;
  const Group& group() const;
  int64_t num_experts() const;
  ExpertRange owned() const;  // this rank's experts
  // This style's exchanges (forward and backward) since it was made or last reset.
  CommStats communication() const;
  void reset_communication() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace mdist::ep
