// A fully_shard unit: unshard (one all-gather), reshard (storage freed) and the post-backward
// reduction (one reduce-scatter of the sharded gradients, one all-reduce per dtype of the
// replicated ones).
#include "src/fsdp/fsdp_param_group.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <utility>

#include "mdist/error.h"

namespace mdist::detail {

FsdpParamGroup::~FsdpParamGroup() {
  for (auto& hook : hooks) hook.remove();
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
  const c10::OptionalDeviceGuard guard(compute_device);
  gather = start_all_gather(*this, compute_dtype);
}

void FsdpParamGroup::unshard() {
  if (unsharded) return;
  if (params.empty()) {
    unsharded = true;
    return;
  }
  const c10::OptionalDeviceGuard guard(compute_device);
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
  if (!unsharded) return;
  for (const auto& p : params) p.free_full();
  unsharded = false;
}

void FsdpParamGroup::discard_gather() {
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
  const std::vector<at::Tensor> reduced = reduce_scatter_gradients(*this, which);
  const at::NoGradGuard no_grad;
  for (std::size_t k = 0; k < which.size(); ++k) {
    if (!reduced[k].defined()) continue;
    at::Tensor shard = params[which[k]].shard();
    at::Tensor grad = reduced[k]
                          .view(shard.sizes())
                          .to(shard_device, shard_dtype,
                              /*non_blocking=*/false, /*copy=*/true);
    at::Tensor& existing = shard.mutable_grad();
    if (existing.defined()) {
      existing.add_(grad);  // accumulating over steps without zero_grad, as autograd would
    } else {
      existing = std::move(grad);
    }
  }
  discard_full_gradients();
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
