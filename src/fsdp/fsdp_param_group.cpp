// A fully_shard unit: unshard (one all-gather), reshard (storage freed) and the post-backward
// reduction (one reduce-scatter of the sharded gradients, one all-reduce per dtype of the
// replicated ones).
#include "src/fsdp/fsdp_param_group.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "mdist/error.h"

namespace mdist::detail {
namespace {

// `t`'s elements (contiguous) as a tensor of `sizes` on the same memory that is not an autograd
// view: Optimizer::zero_grad(false) detaches gradients in place, which a view refuses.
at::Tensor gradient_on(const at::Tensor& t, at::IntArrayRef sizes) {
  if (!t.is_contiguous()) return t.reshape(sizes).clone();
  std::vector<int64_t> strides(sizes.size(), 1);
  for (auto d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * std::max<int64_t>(sizes[d + 1], 1);
  }
  at::Tensor out = at::empty({0}, t.options());
  out.set_(t.storage(), t.storage_offset(), sizes, strides);
  return out;
}

}  // namespace

FsdpParamGroup::~FsdpParamGroup() {
  for (auto& hook : hooks) hook.remove();
  // The backend may still be reading and writing the buffers: they must outlive the work.
  try {
    discard_reduce();
  } catch (...) {  // a failed collective: nothing left to report it to
  }
}

bool FsdpParamGroup::alive() const {
  for (const auto& p : params) {
    if (p.shard().defined()) return true;
  }
  for (const auto& p : replicated) {
    if (p.tensor.lock().defined()) return true;
  }
  return false;
}

void FsdpParamGroup::start_unshard() {
  if (unsharded || gather.started() || params.empty()) return;
  if (world == 1) {
    unshard();
    unsharded_by_prefetch = true;
    return;
  }
  const c10::OptionalDeviceGuard guard(compute_device);
  gather = start_all_gather(*this, compute_dtype);
}

void FsdpParamGroup::unshard_locally() {
  const at::NoGradGuard no_grad;
  for (const auto& p : params) {
    if (p.alias_full()) continue;
    const at::Tensor shard = p.shard();
    if (!shard.defined()) throw Error("mdist: fully_shard: " + label + " no longer exists");
    p.alloc_full();
    const at::Tensor full = p.full();
    if (!full.defined()) continue;
    // From pinned CPU memory (offload) the copy to the device need not block.
    full.variable_data().copy_(shard.reshape(full.sizes()), /*non_blocking=*/true);
  }
}

void FsdpParamGroup::unshard() {
  unsharded_by_prefetch = false;  // used now
  if (unsharded) return;
  if (params.empty()) {
    unsharded = true;
    return;
  }
  const c10::OptionalDeviceGuard guard(compute_device);
  if (world == 1) {
    unshard_locally();
    unsharded = true;
    return;
  }
  start_unshard();
  const at::Tensor gathered = finish_all_gather(gather, *this);
  const at::NoGradGuard no_grad;
  for (const auto& p : params) {
    p.alloc_full();
    const at::Tensor full = p.full();
    // variable_data(): writes that do not bump the version counter autograd checks, as the
    // refilled values are the ones it saved.
    if (full.defined()) unpack_rows(*this, p, gathered, full.variable_data());
  }
  unsharded = true;
}

void FsdpParamGroup::reshard() {
  unsharded_by_prefetch = false;
  if (!unsharded) return;
  for (const auto& p : params) p.free_full();
  unsharded = false;
}

void FsdpParamGroup::discard_gather() {
  if (unsharded_by_prefetch) reshard();
  if (!gather.started()) return;
  static_cast<void>(finish_all_gather(gather, *this));
}

void FsdpParamGroup::invalidate() {
  discard_gather();
  reshard();
}

void FsdpParamGroup::post_backward() {
  const c10::OptionalDeviceGuard guard(compute_device);
  if (requires_gradient_sync) {
    reduce_sharded_gradients();
    reduce_replicated_gradients();
  }
  if (reshard_after_backward) reshard();
  pending_backwards = 0;
  state = TrainingState::kPostBackward;
}

void FsdpParamGroup::discard_full_gradients() {
  for (const auto& p : params) {
    if (at::Tensor full = p.full(); full.defined()) full.mutable_grad() = at::Tensor();
  }
}

void FsdpParamGroup::reduce_sharded_gradients() {
  finish_reduce();  // a backward's earlier reduction of this unit (a unit run twice)
  // Only parameters that can have a gradient take part; a frozen unit communicates nothing.
  // requires_grad is the same on every rank, so every rank skips or joins alike.
  std::vector<std::size_t> which;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (const at::Tensor shard = params[i].shard(); shard.defined() && shard.requires_grad()) {
      which.push_back(i);
    }
  }
  if (which.empty()) {
    discard_full_gradients();
    return;
  }
  if (world == 1) {
    assign_gradients(which, reduce_locally(*this, which));
  } else {
    reduce = start_reduce_scatter(*this, std::move(which));  // copies the full gradients
  }
  discard_full_gradients();
}

void FsdpParamGroup::finish_reduce() {
  if (!reduce.started()) return;
  const c10::OptionalDeviceGuard guard(compute_device);
  const std::vector<std::size_t> which = reduce.which;
  assign_gradients(which, finish_reduce_scatter(reduce, *this));
}

void FsdpParamGroup::discard_reduce() {
  if (!reduce.started()) return;
  static_cast<void>(finish_reduce_scatter(reduce, *this));
}

void FsdpParamGroup::assign_gradients(const std::vector<std::size_t>& which,
                                      const std::vector<at::Tensor>& reduced) {
  const at::NoGradGuard no_grad;
  for (std::size_t k = 0; k < which.size(); ++k) {
    if (!reduced[k].defined()) continue;
    at::Tensor shard = params[which[k]].shard();
    if (!shard.defined()) continue;  // the model is gone
    // On the reduced buffer's memory where no conversion is needed (as FSDP2's sharded
    // gradients are views of its reduce-scatter output): no copy.
    at::Tensor grad = gradient_on(reduced[k].to(shard_device, shard_dtype), shard.sizes());
    at::Tensor& existing = shard.mutable_grad();
    if (existing.defined()) {
      existing.add_(grad);  // accumulating over steps without zero_grad, as autograd would
    } else {
      existing = std::move(grad);
    }
  }
}

void FsdpParamGroup::reduce_replicated_gradients() {
  std::vector<at::Tensor> tensors;
  for (const auto& p : replicated) {
    if (at::Tensor tensor = p.tensor.lock(); tensor.defined() && tensor.requires_grad()) {
      tensors.push_back(std::move(tensor));
    }
  }
  if (tensors.empty()) return;
  const std::vector<at::Tensor> averaged = all_reduce_gradients(*this, tensors);
  const at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!averaged[i].defined()) continue;
    at::Tensor& grad = tensors[i].mutable_grad();
    if (grad.defined()) {
      grad.copy_(averaged[i]);
    } else {
      grad = averaged[i].clone();
    }
  }
}

std::vector<at::Tensor> FsdpParamGroup::gather_full_parameters(const c10::Device& device) const {
  std::vector<at::Tensor> full;
  if (params.empty()) return full;
  const c10::OptionalDeviceGuard guard(compute_device);
  PendingGather pending = start_all_gather(*this, shard_dtype);
  const at::Tensor gathered = finish_all_gather(pending, *this);
  const at::NoGradGuard no_grad;
  for (const auto& p : params) {
    at::Tensor tensor = at::empty(p.full_shape(), at::TensorOptions().dtype(shard_dtype));
    unpack_rows(*this, p, gathered, tensor);
    full.push_back(tensor.to(device));
  }
  return full;
}

}  // namespace mdist::detail
