// Expert parallelism: token dispatch to the experts' owners and the combine, on c10d's
// all_to_all_single.
#include "mdist/ep/dispatch.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mdist/error.h"
#include "mdist/nn/hooks.h"
#include "mdist/runtime/c10d.h"
#include "mdist/runtime/device.h"
#include "mdist/runtime/runtime.h"

namespace mdist::ep {
namespace {

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
                    std::vector<int64_t> output_splits, const Group& group,
                    CommCounters* counters) {
  at::Tensor in = input.detach().contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] = total(output_splits);
  at::Tensor out = at::empty(shape, in.options());
  const int64_t row_bytes = in.dim() == 0 ? 0
                                          : (in.numel() / std::max<int64_t>(in.size(0), 1)) *
                                                static_cast<int64_t>(in.element_size());
  const int me = rank(group);
  if (counters != nullptr) {
    counters->add((total(input_splits) - input_splits[static_cast<std::size_t>(me)]) * row_bytes);
  }
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
                   std::vector<int64_t> output_shape, at::TensorOptions options, Group group,
                   std::shared_ptr<CommCounters> counters)
      : in_splits_(std::move(in_splits)),
        out_splits_(std::move(out_splits)),
        output_shape_(std::move(output_shape)),
        options_(options),
        group_(std::move(group)),
        counters_(std::move(counters)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const at::Tensor grad = grads[0].defined() ? grads[0] : at::zeros(output_shape_, options_);
    // What came from rank r goes back to rank r.
    return {exchange(grad, out_splits_, in_splits_, group_, counters_.get())};
  }
  std::string name() const override { return "mdist::ep::AllToAllBackward"; }

 private:
  std::vector<int64_t> in_splits_, out_splits_, output_shape_;
  at::TensorOptions options_;
  Group group_;
  std::shared_ptr<CommCounters> counters_;
};

}  // namespace

at::Tensor all_to_all(const at::Tensor& input, std::span<const int64_t> input_splits,
                      std::span<const int64_t> output_splits, const Group& group,
                      const std::shared_ptr<CommCounters>& counters) {
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
  at::Tensor output = exchange(input, in_splits, out_splits, group, counters.get());
  if (!at::GradMode::is_enabled()) return output;
  auto node = c10::make_intrusive<AllToAllBackward>(std::move(in_splits), std::move(out_splits),
                                                    output.sizes().vec(), output.options(), group,
                                                    counters);
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

Dispatch plan_dispatch(std::span<const int64_t> per_expert, int64_t num_experts,
                       const Group& group) {
  const ExpertRange mine = owned_experts(num_experts, group);
  const int ranks = size(group);
  if (static_cast<int64_t>(per_expert.size()) != num_experts) {
    throw Error("mdist::ep::plan_dispatch: " + std::to_string(per_expert.size()) + " counts for " +
                std::to_string(num_experts) + " experts");
  }
  Dispatch plan;
  // Rows to each rank: the experts of that rank, in order.
  plan.input_splits.assign(static_cast<std::size_t>(ranks), 0);
  for (int64_t e = 0; e < num_experts; ++e) plan.input_splits[e / mine.count] += per_expert[e];
  // recv[r * local + e]: rows rank r sends to this rank's local expert e.
  const std::vector<int64_t> recv = exchange_counts(per_expert, mine.count, group);
  plan.output_splits.assign(static_cast<std::size_t>(ranks), 0);
  for (int r = 0; r < ranks; ++r) {
    for (int64_t e = 0; e < mine.count; ++e) plan.output_splits[r] += recv[r * mine.count + e];
  }
  // Arrived rows are grouped by source rank, then by expert; the experts want them grouped by
  // expert. by_expert lists arrived rows in expert-major order.
  std::vector<int64_t> by_expert;
  by_expert.reserve(static_cast<std::size_t>(total(plan.output_splits)));
  std::vector<int64_t> source_start(static_cast<std::size_t>(ranks) + 1, 0);
  for (int r = 0; r < ranks; ++r) source_start[r + 1] = source_start[r] + plan.output_splits[r];
  plan.rows_per_local.assign(static_cast<std::size_t>(mine.count), 0);
  for (int64_t e = 0; e < mine.count; ++e) {
    for (int r = 0; r < ranks; ++r) {
      int64_t offset = source_start[r];
      for (int64_t before = 0; before < e; ++before) offset += recv[r * mine.count + before];
      const int64_t n = recv[r * mine.count + e];
      for (int64_t i = 0; i < n; ++i) by_expert.push_back(offset + i);
      plan.rows_per_local[e] += n;
    }
  }
  plan.by_expert = at::tensor(by_expert, at::TensorOptions().dtype(at::kLong));
  return plan;
}

at::Tensor dispatch(const at::Tensor& sorted, const Dispatch& plan, const Group& group,
                    const std::shared_ptr<CommCounters>& counters) {
  const at::Tensor arrived =
      all_to_all(sorted, plan.input_splits, plan.output_splits, group, counters);
  return arrived.index_select(0, plan.by_expert.to(sorted.device()));
}

at::Tensor undispatch(const at::Tensor& processed, const at::Tensor& grouped, const Dispatch& plan,
                      const Group& group, const std::shared_ptr<CommCounters>& counters) {
  at::Tensor back = processed.size(0) == 0 ? grouped.narrow(0, 0, 0) : processed;
  // Back to arrival order (inverse permutation), then home.
  if (back.size(0) > 0) {
    back = back.index_select(0, std::get<1>(plan.by_expert.to(back.device()).sort()));
  }
  return all_to_all(back, plan.output_splits, plan.input_splits, group, counters);
}

at::Tensor dispatch_combine(const at::Tensor& hidden, const at::Tensor& index,
                            const at::Tensor& weight, int64_t num_experts, const Group& group,
                            const ExpertFn& expert, const std::shared_ptr<CommCounters>& counters) {
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
  (void)owned_experts(num_experts, group);  // checks the split before anything is read
  const int64_t tokens = hidden.size(0), top_k = index.size(1), width = hidden.size(1);

  const at::Tensor flat = index.reshape({-1}).cpu();
  if (flat.numel() > 0 &&
      (flat.min().item<int64_t>() < 0 || flat.max().item<int64_t>() >= num_experts)) {
    throw Error("mdist::ep::dispatch_combine: an expert index outside [0, " +
                std::to_string(num_experts) + ")");
  }
  // (token, slot) pairs sorted by expert, stable so that equal experts keep token order.
  const at::Tensor order =
      std::get<1>(flat.sort(std::optional<bool>(true), /*dim=*/0, /*descending=*/false));
  const at::Tensor token_of = at::floor_divide(order, top_k);
  const at::Tensor per_expert = at::bincount(flat, {}, num_experts);
  const Dispatch plan = plan_dispatch(
      {per_expert.data_ptr<int64_t>(), static_cast<std::size_t>(num_experts)}, num_experts, group);

  const at::Tensor sorted = hidden.index_select(0, token_of.to(hidden.device()));
  const at::Tensor grouped = dispatch(sorted, plan, group, counters);

  std::vector<at::Tensor> outputs;
  int64_t start = 0;
  for (std::size_t e = 0; e < plan.rows_per_local.size(); ++e) {
    const int64_t n = plan.rows_per_local[e];
    if (n == 0) continue;
    at::Tensor out = expert(static_cast<int64_t>(e), grouped.narrow(0, start, n));
    if (out.dim() != 2 || out.size(0) != n || out.size(1) != width) {
      throw Error("mdist::ep::dispatch_combine: local expert " + std::to_string(e) + " returned " +
                  c10::str(out.sizes()) + " for " + std::to_string(n) + " rows of width " +
                  std::to_string(width));
    }
    outputs.push_back(std::move(out));
    start += n;
  }
  const at::Tensor processed = outputs.empty() ? grouped.narrow(0, 0, 0) : at::cat(outputs, 0);
  const at::Tensor returned = undispatch(processed, grouped, plan, group, counters);
  // returned[i] belongs to (token, slot) order[i]; weight it and add it to its token.
  const at::Tensor slot_weight =
      weight.reshape({-1}).index_select(0, order.to(weight.device())).unsqueeze(1);
  at::Tensor combined = at::zeros({tokens, width}, returned.options().dtype(hidden.scalar_type()));
  return combined.index_add(0, token_of.to(hidden.device()),
                            (returned * slot_weight).to(hidden.scalar_type()));
}

// The hooks' shared state: the group, the counters, and the dispatch of the call in flight
// (set by the pre-hook, taken by the post-hook; a module is not called inside itself).
struct ExpertParallel::State {
  Group group;
  int64_t num_experts = 0;
  ExpertRange owned;
  std::shared_ptr<CommCounters> counters = std::make_shared<CommCounters>();
  struct InFlight {
    Dispatch plan;
    at::Tensor grouped;
    at::Tensor restore;  // the caller's order from the token order the rows were sent in
  };
  std::optional<InFlight> in_flight;

  // inputs: rows [M, hidden] sorted by expert, counts [num_experts], tokens [M].
  void before(nn::TensorRefs& inputs) {
    if (inputs.size() < 3) {
      throw Error("mdist::ep::ExpertParallel: expected (rows, counts, tokens)");
    }
    const at::Tensor counts = inputs[1]->to(at::kCPU, at::kLong).contiguous();
    const at::Tensor tokens = inputs[2]->to(at::kCPU, at::kLong);
    // Each expert's rows by token (a token meets an expert once): the rows sorted by
    // (expert, token), as dispatch_combine's stable sort of the (token, slot) pairs.
    const at::Tensor expert_of = at::repeat_interleave(counts);
    const int64_t span = tokens.numel() > 0 ? tokens.max().item<int64_t>() + 1 : 1;
    const at::Tensor by_token = std::get<1>(
        (expert_of * span + tokens).sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
    InFlight call{
        plan_dispatch({counts.data_ptr<int64_t>(), static_cast<std::size_t>(counts.numel())},
                      num_experts, group),
        {},
        std::get<1>(by_token.sort())};
    const at::Tensor& rows = *inputs[0];
    call.grouped =
        dispatch(rows.index_select(0, by_token.to(rows.device())), call.plan, group, counters);
    *inputs[0] = call.grouped;
    *inputs[1] = at::tensor(call.plan.rows_per_local, at::TensorOptions().dtype(at::kLong));
    *inputs[2] = at::Tensor();  // the arrived rows' tokens are other ranks'
    in_flight = std::move(call);
  }
  void after(nn::TensorRefs& outputs) {
    if (!in_flight || outputs.empty()) return;
    InFlight call = std::move(*in_flight);
    in_flight.reset();
    const at::Tensor returned =
        undispatch(*outputs.front(), call.grouped, call.plan, group, counters);
    *outputs.front() = returned.index_select(0, call.restore.to(returned.device()));
  }
};

ExpertParallel::ExpertParallel(Group group, int64_t num_experts)
    : state_(std::make_shared<State>()) {
  state_->owned = owned_experts(num_experts, group);
  state_->group = std::move(group);
  state_->num_experts = num_experts;
}

void ExpertParallel::apply(torch::nn::Module& module) const {
  const std::shared_ptr<State> state = state_;
  nn::register_forward_pre_hook(
      module, [state](torch::nn::Module&, nn::TensorRefs& inputs) { state->before(inputs); });
  nn::register_forward_hook(
      module, [state](torch::nn::Module&, nn::TensorRefs& outputs) { state->after(outputs); });
  nn::register_forward_error_hook(module,
                                  [state](torch::nn::Module&) { state->in_flight.reset(); });
}

const Group& ExpertParallel::group() const { return state_->group; }
int64_t ExpertParallel::num_experts() const { return state_->num_experts; }
ExpertRange ExpertParallel::owned() const { return state_->owned; }
CommStats ExpertParallel::communication() const { return state_->counters->stats(); }
void ExpertParallel::reset_communication() const { state_->counters->reset(); }

}  // namespace mdist::ep
