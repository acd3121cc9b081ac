// Packing, all-gather, reduce-scatter and all-reduce for fully_shard units.
#include "src/fsdp/fsdp_collectives.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <tuple>
#include <utility>

#include "mdist/error.h"
#include "mdist/runtime/c10d.h"
#include "mdist/runtime/runtime.h"
#include "src/fsdp/fsdp_param_group.h"

namespace mdist::detail {
namespace {

// The unit's process group, or an error that says the model outlived it.
c10::intrusive_ptr<c10d::ProcessGroup> unit_group(const FsdpParamGroup& unit) {
  if (unit.options.group.is_world() && !is_initialized()) {
    throw CommunicationError("mdist: fully_shard: the model is sharded over the world (" +
                             std::to_string(unit.world) +
                             " ranks), whose process group was destroyed by cleanup()");
  }
  return process_group(unit.options.group);
}

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Waits for `work`, adding the time blocked to the unit's statistics.
void timed_wait(const FsdpParamGroup& unit, const c10::intrusive_ptr<c10d::Work>& work,
                const char* what) {
  const auto start = std::chrono::steady_clock::now();
  mdist::wait(work, unit.options.group, what);
  unit.comm.wait_s +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// This rank's shards of `unit`, packed into one flat buffer of `dtype` on the compute device.
at::Tensor pack_shards(const FsdpParamGroup& unit, c10::ScalarType dtype) {
  const at::NoGradGuard no_grad;
  at::Tensor local =
      at::empty({unit.flat_numel}, at::TensorOptions().dtype(dtype).device(unit.compute_device));
  for (const auto& p : unit.params) {
    const at::Tensor shard = p.shard();
    if (!shard.defined()) throw Error("mdist: fully_shard: " + unit.label + " no longer exists");
    // From pinned CPU memory (offload) the copy to the device need not block.
    local.narrow(0, p.offset(), p.shard_numel()).copy_(shard.reshape({-1}), /*non_blocking=*/true);
  }
  return local;
}

}  // namespace

PendingGather start_all_gather(const FsdpParamGroup& unit, c10::ScalarType dtype) {
  PendingGather pending;
  pending.input = pack_shards(unit, dtype);
  if (unit.world == 1) {
    pending.output = pending.input;
    return pending;
  }
  pending.output = at::empty({unit.world * unit.flat_numel}, pending.input.options());
  // Asynchronous: the backend runs it while this rank computes.
  pending.work = unit_group(unit)->all_gather_single(pending.output, pending.input);
  ++unit.comm.all_gathers;
  unit.comm.all_gather_bytes += nbytes(pending.output);
  return pending;
}

at::Tensor finish_all_gather(PendingGather& pending, const FsdpParamGroup& unit) {
  PendingGather done = std::move(pending);
  pending = PendingGather();
  if (done.work) timed_wait(unit, done.work, "fully_shard all-gather");
  return done.output;
}

void unpack_rows(const FsdpParamGroup& unit, const FsdpParam& param, const at::Tensor& gathered,
                 const at::Tensor& full) {
  at::Tensor flat = full.view({-1});
  for (int r = 0; r < unit.world; ++r) {
    const OwnedRows rows = param.owned(r);
    if (rows.count <= 0) break;
    flat.narrow(0, rows.first * param.row_numel(), rows.count * param.row_numel())
        .copy_(gathered.narrow(0, r * unit.flat_numel + param.offset(),
                               rows.count * param.row_numel()));
  }
}

std::vector<at::Tensor> reduce_locally(const FsdpParamGroup& unit,
                                       const std::vector<std::size_t>& which) {
  const at::NoGradGuard no_grad;
  const double divisor = unit.options.gradient_divide_factor.value_or(1.0);
  std::vector<at::Tensor> shards;
  for (const std::size_t i : which) {
    const at::Tensor full = unit.params[i].full();
    at::Tensor grad = full.defined() ? full.grad() : at::Tensor();
    if (grad.defined()) {
      grad = grad.to(unit.reduce_dtype);
      if (divisor != 1.0) grad = grad.div(divisor);
    }
    shards.push_back(std::move(grad));
  }
  return shards;
}

PendingReduce start_reduce_scatter(const FsdpParamGroup& unit, std::vector<std::size_t> which) {
  const at::NoGradGuard no_grad;
  PendingReduce pending;
  pending.which = std::move(which);
  const auto n = static_cast<int64_t>(pending.which.size());
  // Each rank's chunk: one has-gradient flag per parameter, then its rows of each gradient.
  // Summed flags tell every rank which parameters got a gradient on any rank, so only those
  // get one (the rest keep none, as in a single process), in the same one collective.
  int64_t numel = n;
  for (const std::size_t i : pending.which) {
    pending.offsets.push_back(numel);
    numel += unit.params[i].shard_numel();
  }
  const auto options = at::TensorOptions().dtype(unit.reduce_dtype).device(unit.compute_device);
  // Not zero-filled as a whole: every element is written once below (gradient rows, or zero
  // for flags, padding and missing gradients).
  pending.input = at::empty({unit.world, numel}, options);
  pending.input.narrow(1, 0, n).zero_();
  for (int64_t k = 0; k < n; ++k) {
    const FsdpParam& p = unit.params[pending.which[k]];
    const at::Tensor section = pending.input.narrow(1, pending.offsets[k], p.shard_numel());
    const at::Tensor full = p.full();
    const at::Tensor grad = full.defined() ? full.grad() : at::Tensor();
    if (!grad.defined()) {
      section.zero_();
      continue;
    }
    pending.input.select(1, k).fill_(1);
    // Rank r's chunk gets rows [r*c, r*c + c) of the gradient, then zero padding.
    const at::Tensor rows = grad.reshape({p.rows(), p.row_numel()});
    for (int r = 0; r < unit.world; ++r) {
      const OwnedRows owned = p.owned(r);
      const int64_t real = std::max<int64_t>(owned.count, 0) * p.row_numel();
      const at::Tensor chunk = section[r];
      if (real > 0) {
        chunk.narrow(0, 0, real)
            .view({owned.count, p.row_numel()})
            .copy_(rows.narrow(0, owned.first, owned.count));
      }
      if (real < p.shard_numel()) chunk.narrow(0, real, p.shard_numel() - real).zero_();
    }
  }
  pending.output = at::empty({numel}, options);
  at::Tensor flat_input = pending.input.view({-1});
  c10d::ReduceScatterOptions rs;
  rs.reduceOp = c10d::ReduceOp::SUM;
  // Asynchronous: the backend runs it while this rank computes the next unit's backward.
  pending.work = unit_group(unit)->reduce_scatter_single(pending.output, flat_input, rs);
  ++unit.comm.reduce_scatters;
  unit.comm.reduce_scatter_bytes += nbytes(flat_input);
  return pending;
}

std::vector<at::Tensor> finish_reduce_scatter(PendingReduce& pending, const FsdpParamGroup& unit) {
  PendingReduce done = std::move(pending);
  pending = PendingReduce();
  timed_wait(unit, done.work, "fully_shard reduce-scatter");
  const at::NoGradGuard no_grad;
  const double divisor = unit.options.gradient_divide_factor.value_or(unit.world);
  at::Tensor reduced = done.output;
  if (divisor != 1.0) reduced.div_(divisor);
  const auto n = static_cast<int64_t>(done.which.size());
  // One device-to-host copy for every flag.
  const at::Tensor flags = reduced.narrow(0, 0, n).to(at::kCPU, at::kFloat);
  const float* const flag = flags.data_ptr<float>();
  std::vector<at::Tensor> shards(done.which.size());
  for (int64_t k = 0; k < n; ++k) {
    if (flag[k] <= 0) continue;
    shards[k] = reduced.narrow(0, done.offsets[k], unit.params[done.which[k]].shard_numel());
  }
  return shards;
}

std::vector<at::Tensor> all_reduce_gradients(const FsdpParamGroup& unit,
                                             const std::vector<at::Tensor>& params) {
  const at::NoGradGuard no_grad;
  std::vector<at::Tensor> averaged(params.size());
  // One buffer per dtype and device, in an order every rank agrees on.
  std::map<std::tuple<int, int, int>, std::vector<std::size_t>> buckets;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    buckets[{static_cast<int>(p.scalar_type()), static_cast<int>(p.device().type()),
             static_cast<int>(p.device().index())}]
        .push_back(i);
  }
  for (const auto& [key, members] : buckets) {
    const auto n = static_cast<int64_t>(members.size());
    int64_t numel = n;  // has-gradient flags first, as in the reduce-scatter
    std::vector<int64_t> offsets;
    for (const std::size_t i : members) {
      offsets.push_back(numel);
      numel += params[i].numel();
    }
    const at::Tensor& first = params[members.front()];
    at::Tensor buffer = at::zeros({numel}, first.options());
    for (int64_t k = 0; k < n; ++k) {
      const at::Tensor grad = params[members[k]].grad();
      if (!grad.defined()) continue;
      buffer[k].fill_(1);
      buffer.narrow(0, offsets[k], grad.numel()).copy_(grad.reshape({-1}));
    }
    if (unit.world > 1) {
      std::vector<at::Tensor> tensors{buffer};
      c10d::AllreduceOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      ++unit.comm.all_reduces;
      unit.comm.all_reduce_bytes += nbytes(buffer);
      timed_wait(unit, unit_group(unit)->allreduce(tensors, options),
                 "fully_shard all-reduce of replicated gradients");
    }
    const double divisor = unit.options.gradient_divide_factor.value_or(unit.world);
    if (divisor != 1.0) buffer.div_(divisor);
    const at::Tensor flags = buffer.narrow(0, 0, n).to(at::kCPU, at::kFloat);
    const float* const flag = flags.data_ptr<float>();
    for (int64_t k = 0; k < n; ++k) {
      if (flag[k] <= 0) continue;
      const at::Tensor& p = params[members[k]];
      averaged[members[k]] = buffer.narrow(0, offsets[k], p.numel()).view(p.sizes());
    }
  }
  return averaged;
}

}  // namespace mdist::detail
