// Expert parallelism: token dispatch to the experts' owners and the combine, on c10d's
// all_to_all_single.
#include "mdist/ep/dispatch.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "mdist/error.h"
#include "mdist/runtime/c10d.h"
#include "mdist/runtime/device.h"
#include "mdist/runtime/runtime.h"

namespace mdist::ep {
namespace {

std::atomic<int64_t> sent_bytes{0};

int group_size(const Group& group, const char* op) {
  const int ranks = size(group);
  if (ranks < 0) {
    throw Error(std::string("mdist::ep::") + op + ": over " + group.name() +
                ", which this rank is not a member of");
  }
  return ranks;
}

void check_splits(std::span<const int64_t> splits, int ranks, const char* which) {
  if (static_cast<int>(splits.size()) != ranks) {
    throw Error(std::string("mdist::ep::all_to_all: ") + which + " has " +
                std::to_string(splits.size()) + " entries for a group of " + std::to_string(ranks) +
                " ranks");
  }
  for (const int64_t s : splits) {
    if (s < 0) throw Error(std::string("mdist::ep::all_to_all: negative count in ") + which);
  }
}

int64_t total(std::span<const int64_t> splits) {
  return std::accumulate(splits.begin(), splits.end(), int64_t{0});
}

// The exchange itself, without autograd. Rows are dim 0; c10d's split sizes count rows.
at::Tensor exchange(const at::Tensor& input, std::vector<int64_t> input_splits,
                    std::vector<int64_t> output_splits, const Group& group) {
  at::Tensor in = input.detach().contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] = total(output_splits);
  at::Tensor out = at::empty(shape, in.options());
  const int64_t row_bytes = in.dim() == 0 ? 0
                                          : (in.numel() / std::max<int64_t>(in.size(0), 1)) *
                                                static_cast<int64_t>(in.element_size());
  const int me = rank(group);
  sent_bytes += (total(input_splits) - input_splits[static_cast<std::size_t>(me)]) * row_bytes;
  mdist::wait(process_group(group)->all_to_all_single(out, in, output_splits, input_splits), group,
              "ep::all_to_all");
  return out;
}

// The backward of all_to_all: the reverse exchange. Unlike a local op it must run on every
// rank of the group whenever it runs on one (a collective), so it is recorded whenever grad
// mode is on, also for an input that needs no gradient (its result is then dropped), and an
// undefined incoming gradient is sent as zeros rather than skipped.
struct AllToAllBackward : torch::autograd::Node {
  AllToAllBackward(std::vector<int64_t> in_splits, std::vector<int64_t> out_splits,
                   std::vector<int64_t> output_shape, at::TensorOptions options, Group group)
      : in_splits_(std::move(in_splits)),
        out_splits_(std::move(out_splits)),
        output_shape_(std::move(output_shape)),
        options_(options),
        group_(std::move(group)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const at::Tensor grad = grads[0].defined() ? grads[0] : at::zeros(output_shape_, options_);
    // What came from rank r goes back to rank r.
    return {exchange(grad, out_splits_, in_splits_, group_)};
  }
  std::string name() const override { return "mdist::ep::AllToAllBackward"; }

 private:
  std::vector<int64_t> in_splits_, out_splits_, output_shape_;
  at::TensorOptions options_;
  Group group_;
};

}  // namespace

at::Tensor all_to_all(const at::Tensor& input, std::span<const int64_t> input_splits,
                      std::span<const int64_t> output_splits, const Group& group) {
  const int ranks = group_size(group, "all_to_all");
  check_splits(input_splits, ranks, "input_splits");
  check_splits(output_splits, ranks, "output_splits");
  if (input.dim() == 0 || input.size(0) != total(input_splits)) {
    throw Error("mdist::ep::all_to_all: the input has " +
                std::to_string(input.dim() == 0 ? 0 : input.size(0)) +
                " rows, input_splits add up to " + std::to_string(total(input_splits)));
  }
  if (ranks == 1) return input;
  std::vector<int64_t> in_splits(input_splits.begin(), input_splits.end());
  std::vector<int64_t> out_splits(output_splits.begin(), output_splits.end());
  at::Tensor output = exchange(input, in_splits, out_splits, group);
  if (!at::GradMode::is_enabled()) return output;
  auto node = c10::make_intrusive<AllToAllBackward>(std::move(in_splits), std::move(out_splits),
                                                    output.sizes().vec(), output.options(), group);
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  torch::autograd::impl::set_gradient_edge(
      output, torch::autograd::Edge(node, node->add_input_metadata(output)));
  return output;
}

std::vector<int64_t> exchange_counts(std::span<const int64_t> per_destination, int64_t n,
                                     const Group& group) {
  const int ranks = group_size(group, "exchange_counts");
  if (n < 0 || static_cast<int64_t>(per_destination.size()) != ranks * n) {
    throw Error("mdist::ep::exchange_counts: " + std::to_string(per_destination.size()) +
                " counts for " + std::to_string(ranks) + " ranks x " + std::to_string(n));
  }
  std::vector<int64_t> received(per_destination.begin(), per_destination.end());
  if (ranks == 1 || n == 0) return received;
  // Counts travel on the device the group's backend serves for this run: a CPU tensor goes
  // through Gloo; with a CUDA-only group (NCCL) the caller's tensors are on CUDA anyway, so
  // the counts follow them there.
  const c10::Device device = backend().value_or("gloo").find("gloo") != std::string::npos
                                 ? c10::Device(c10::kCPU)
                                 : compute_device();
  at::Tensor send = at::tensor(received, at::TensorOptions().dtype(at::kLong)).to(device);
  at::Tensor recv = at::empty_like(send);
  std::vector<int64_t> splits(static_cast<std::size_t>(ranks), n);
  mdist::wait(process_group(group)->all_to_all_single(recv, send, splits, splits), group,
              "ep::exchange_counts");
  recv = recv.cpu();
  return {recv.data_ptr<int64_t>(), recv.data_ptr<int64_t>() + recv.numel()};
}

ExpertRange owned_experts(int64_t num_experts, const Group& group) {
  const int ranks = group_size(group, "owned_experts");
  if (num_experts <= 0 || num_experts % ranks != 0) {
    throw Error("expert parallelism: " + std::to_string(num_experts) +
                " experts do not divide over an expert-parallel group of " + std::to_string(ranks) +
                " ranks");
  }
  const int64_t per_rank = num_experts / ranks;
  return {rank(group) * per_rank, per_rank};
}

at::Tensor dispatch_combine(const at::Tensor& hidden, const at::Tensor& index,
                            const at::Tensor& weight, int64_t num_experts, const Group& group,
                            const ExpertFn& expert) {
  if (hidden.dim() != 2 || index.dim() != 2 || weight.sizes() != index.sizes() ||
      index.size(0) != hidden.size(0)) {
    throw Error(
        "mdist::ep::dispatch_combine: expected hidden [tokens, hidden] and index, weight "
        "[tokens, top_k]; got hidden " +
        c10::str(hidden.sizes()) + ", index " + c10::str(index.sizes()) + ", weight " +
        c10::str(weight.sizes()));
  }
  if (index.scalar_type() != at::kLong) {
    throw Error("mdist::ep::dispatch_combine: expert indices must be int64");
  }
  const ExpertRange mine = owned_experts(num_experts, group);
  const int ranks = size(group);
  const int64_t tokens = hidden.size(0), top_k = index.size(1), width = hidden.size(1);

  const at::Tensor flat = index.reshape({-1}).cpu();
  if (flat.numel() > 0 &&
      (flat.min().item<int64_t>() < 0 || flat.max().item<int64_t>() >= num_experts)) {
    throw Error("mdist::ep::dispatch_combine: an expert index outside [0, " +
                std::to_string(num_experts) + ")");
  }
  // (token, slot) pairs sorted by expert, stable so that equal experts keep token order.
  const at::Tensor order = std::get<1>(flat.sort(std::optional<bool>(true), /*dim=*/0, /*descending=*/false));
  const at::Tensor token_of = at::floor_divide(order, top_k);
  const at::Tensor per_expert = at::bincount(flat, {}, num_experts);
  const std::vector<int64_t> send_counts(per_expert.data_ptr<int64_t>(),
                                         per_expert.data_ptr<int64_t>() + num_experts);

  // Rows to each rank: the experts of that rank, in order.
  std::vector<int64_t> input_splits(static_cast<std::size_t>(ranks), 0);
  for (int64_t e = 0; e < num_experts; ++e) input_splits[e / mine.count] += send_counts[e];
  // recv[r * local + e]: rows rank r sends to this rank's local expert e.
  const std::vector<int64_t> recv = exchange_counts(send_counts, mine.count, group);
  std::vector<int64_t> output_splits(static_cast<std::size_t>(ranks), 0);
  for (int r = 0; r < ranks; ++r) {
    for (int64_t e = 0; e < mine.count; ++e) output_splits[r] += recv[r * mine.count + e];
  }

  const at::Tensor sorted = hidden.index_select(0, token_of.to(hidden.device()));
  const at::Tensor arrived = all_to_all(sorted, input_splits, output_splits, group);

  // Arrived rows are grouped by source rank, then by expert; the experts want them grouped by
  // expert. by_expert lists arrived rows in expert-major order.
  std::vector<int64_t> by_expert;
  by_expert.reserve(static_cast<std::size_t>(arrived.size(0)));
  std::vector<int64_t> source_start(static_cast<std::size_t>(ranks) + 1, 0);
  for (int r = 0; r < ranks; ++r) source_start[r + 1] = source_start[r] + output_splits[r];
  std::vector<int64_t> rows_of_expert(static_cast<std::size_t>(mine.count), 0);
  for (int64_t e = 0; e < mine.count; ++e) {
    for (int r = 0; r < ranks; ++r) {
      int64_t offset = source_start[r];
      for (int64_t before = 0; before < e; ++before) offset += recv[r * mine.count + before];
      const int64_t n = recv[r * mine.count + e];
      for (int64_t i = 0; i < n; ++i) by_expert.push_back(offset + i);
      rows_of_expert[e] += n;
    }
  }
  const at::Tensor permutation =
      at::tensor(by_expert, at::TensorOptions().dtype(at::kLong)).to(hidden.device());
  const at::Tensor grouped = arrived.index_select(0, permutation);

  std::vector<at::Tensor> outputs;
  int64_t start = 0;
  for (int64_t e = 0; e < mine.count; ++e) {
    const int64_t n = rows_of_expert[e];
    if (n == 0) continue;
    at::Tensor out = expert(e, grouped.narrow(0, start, n));
    if (out.dim() != 2 || out.size(0) != n || out.size(1) != width) {
      throw Error("mdist::ep::dispatch_combine: local expert " + std::to_string(e) + " returned " +
                  c10::str(out.sizes()) + " for " + std::to_string(n) + " rows of width " +
                  std::to_string(width));
    }
    outputs.push_back(std::move(out));
    start += n;
  }
  // With no rows here the (empty) result still hangs off `grouped`, so that this rank's graph
  // has the same all-to-all nodes as every other rank's.
  at::Tensor processed = outputs.empty() ? grouped.narrow(0, 0, 0) : at::cat(outputs, 0);
  // Back to arrival order (inverse permutation), then home.
  if (processed.size(0) > 0) {
    processed = processed.index_select(0, std::get<1>(permutation.sort()));
  }
  const at::Tensor returned = all_to_all(processed, output_splits, input_splits, group);
  // returned[i] belongs to (token, slot) order[i]; weight it and add it to its token.
  const at::Tensor slot_weight =
      weight.reshape({-1}).index_select(0, order.to(weight.device())).unsqueeze(1);
  at::Tensor combined = at::zeros({tokens, width}, returned.options().dtype(hidden.scalar_type()));
  return combined.index_add(0, token_of.to(hidden.device()),
                            (returned * slot_weight).to(hidden.scalar_type()));
}

int64_t all_to_all_bytes() { return sent_bytes.load(); }
void reset_all_to_all_bytes() { sent_bytes = 0; }

}  // namespace mdist::ep
