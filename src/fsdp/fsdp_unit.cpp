// Unshard (one all-gather per unit), reshard (storage freed), and the post-backward
// reduce-scatter (one per unit) of a fully_shard unit.
#include "src/fsdp/fsdp_unit.h"

#include "mdist/error.h"
#include "mdist/runtime/c10d.h"
#include "mdist/runtime/runtime.h"

namespace mdist::detail {
namespace {

// The full parameter keeps its TensorImpl (autograd saved it for backward); only its storage
// grows and shrinks, so the memory is really released between uses.
void allocate_storage(const at::Tensor& tensor) {
  c10::StorageImpl* const storage = tensor.storage().unsafeGetStorageImpl();
  const auto nbytes = static_cast<std::size_t>(tensor.numel()) * tensor.element_size();
  if (storage->nbytes() >= nbytes) return;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

}  // namespace

void free_storage(const at::Tensor& tensor) {
  c10::StorageImpl* const storage = tensor.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
}

namespace {

// The unit's process group, or an error that says the model outlived it.
c10::intrusive_ptr<c10d::ProcessGroup> unit_group(const FsdpUnit& unit) {
  if (unit.options.group.is_world() && !is_initialized()) {
    throw CommunicationError("mdist: fully_shard: the model is sharded over the world (" +
                             std::to_string(unit.world) +
                             " ranks), whose process group was destroyed by cleanup()");
  }
  return process_group(unit.options.group);
}

// This rank's shards of `unit`, packed into one flat buffer of `dtype`.
at::Tensor pack_shards(const FsdpUnit& unit, c10::ScalarType dtype) {
  const at::NoGradGuard no_grad;
  at::Tensor local =
      at::empty({unit.flat_numel}, at::TensorOptions().dtype(dtype).device(unit.compute_device));
  for (const auto& p : unit.params) {
    // From pinned CPU memory (offload) the copy to the device need not block.
    local.narrow(0, p.offset, p.shard_numel()).copy_(p.shard.reshape({-1}), /*non_blocking=*/true);
  }
  return local;
}

// Every rank's shards of `unit`, gathered now: [world * flat_numel] in `dtype`.
at::Tensor all_gather_shards(const FsdpUnit& unit, c10::ScalarType dtype) {
  at::Tensor local = pack_shards(unit, dtype);
  if (unit.world == 1) return local;
  at::Tensor gathered = at::empty({unit.world * unit.flat_numel}, local.options());
  const auto pg = unit_group(unit);
  mdist::wait(pg->all_gather_single(gathered, local), unit.options.group, "fully_shard all-gather");
  return gathered;
}

// Copies parameter `p`'s rows out of the gathered buffer into `full` (contiguous, full size),
// dropping the padding.
void unpack_rows(const FsdpUnit& unit, const ManagedParam& p, const at::Tensor& gathered,
                 const at::Tensor& full) {
  at::Tensor flat = full.view({-1});
  for (int r = 0; r < unit.world; ++r) {
    const OwnedRows rows = owned_rows(p, r);
    if (rows.count <= 0) break;
    flat.narrow(0, rows.first * p.row_numel, rows.count * p.row_numel)
        .copy_(gathered.narrow(0, r * unit.flat_numel + p.offset, rows.count * p.row_numel));
  }
}

}  // namespace

void FsdpUnit::start_unshard() {
  if (unsharded || gather_started) return;
  gather_input = pack_shards(*this, compute_dtype);
  if (world == 1) {
    gather_output = gather_input;
  } else {
    gather_output = at::empty({world * flat_numel}, gather_input.options());
    // Asynchronous: Gloo runs it on its own threads while this rank computes.
    gather_work = unit_group(*this)->all_gather_single(gather_output, gather_input);
  }
  gather_started = true;
}

void FsdpUnit::unshard() {
  if (unsharded) return;
  start_unshard();
  if (gather_work) {
    const auto work = std::move(gather_work);
    gather_work.reset();
    gather_started = false;
    mdist::wait(work, options.group, "fully_shard all-gather");
  }
  gather_started = false;
  const at::Tensor gathered = std::move(gather_output);
  gather_input = at::Tensor();
  gather_output = at::Tensor();
  const at::NoGradGuard no_grad;
  for (auto& p : params) {
    allocate_storage(p.unsharded);
    // variable_data(): writes that do not bump the version counter autograd checks, as the
    // refilled values are the ones it saved.
    unpack_rows(*this, p, gathered, p.unsharded.variable_data());
  }
  unsharded = true;
}

std::vector<at::Tensor> FsdpUnit::gather_full_parameters(const c10::Device& device) const {
  const at::Tensor gathered = all_gather_shards(*this, shard_dtype);
  const at::NoGradGuard no_grad;
  std::vector<at::Tensor> full;
  for (const auto& p : params) {
    at::Tensor tensor = at::empty(p.full_shape, at::TensorOptions().dtype(shard_dtype));
    unpack_rows(*this, p, gathered, tensor);
    full.push_back(tensor.to(device));
  }
  return full;
}

void FsdpUnit::reshard() {
  if (!unsharded) return;
  for (const auto& p : params) free_storage(p.unsharded);
  unsharded = false;
}

void FsdpUnit::post_backward() {
  if (!backward_pending) return;
  backward_pending = false;
  if (requires_gradient_sync) reduce_scatter_gradients();
  if (reshard_after_backward) reshard();
}

void FsdpUnit::reduce_scatter_gradients() {
  const at::NoGradGuard no_grad;
  bool any = false;
  for (const auto& p : params) any = any || p.unsharded.grad().defined();
  if (!any) return;
  const auto options_of = at::TensorOptions().dtype(reduce_dtype).device(compute_device);
  // Rank r's chunk of the input holds its rows of every parameter, so one reduce-scatter
  // leaves each rank the summed gradient of exactly its shards.
  at::Tensor input = at::zeros({world, flat_numel}, options_of);
  for (const auto& p : params) {
    const at::Tensor grad = p.unsharded.grad();
    if (!grad.defined()) continue;
    at::Tensor padded = at::zeros({world * p.chunk_rows, p.row_numel}, options_of);
    padded.narrow(0, 0, p.rows).copy_(grad.reshape({p.rows, p.row_numel}));
    input.narrow(1, p.offset, p.shard_numel()).copy_(padded.view({world, p.shard_numel()}));
  }
  at::Tensor reduced = input.view({-1});
  if (world > 1) {
    reduced = at::empty({flat_numel}, options_of);
    at::Tensor flat_input = input.view({-1});
    const auto pg = unit_group(*this);
    c10d::ReduceScatterOptions rs;
    rs.reduceOp = c10d::ReduceOp::SUM;
    mdist::wait(pg->reduce_scatter_single(reduced, flat_input, rs), options.group,
                "fully_shard reduce-scatter");
    reduced.div_(world);
  }
  for (auto& p : params) {
    at::Tensor shard_grad = reduced.narrow(0, p.offset, p.shard_numel())
                                .view(p.shard.sizes())
                                .to(shard_device, shard_dtype, /*non_blocking=*/false,
                                    /*copy=*/true);
    at::Tensor& grad = p.shard.mutable_grad();
    if (grad.defined()) {
      grad.add_(shard_grad);
    } else {
      grad = shard_grad;
    }
    p.unsharded.mutable_grad() = at::Tensor();
  }
}

}  // namespace mdist::detail
