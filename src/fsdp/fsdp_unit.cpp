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

void FsdpUnit::unshard() {
  if (unsharded) return;
  const at::NoGradGuard no_grad;
  const auto options_of = at::TensorOptions().dtype(compute_dtype);
  at::Tensor local = at::empty({flat_numel}, options_of);
  for (const auto& p : params) {
    local.narrow(0, p.offset, p.shard_numel()).copy_(p.shard.reshape({-1}));
  }
  at::Tensor gathered = local;
  if (world > 1) {
    gathered = at::empty({world * flat_numel}, options_of);
    const auto pg = process_group(options.group);
    mdist::wait(pg->all_gather_single(gathered, local), options.group, "fully_shard all-gather");
  }
  for (auto& p : params) {
    allocate_storage(p.unsharded);
    // variable_data(): writes that do not bump the version counter autograd checks, as the
    // refilled values are the ones it saved.
    at::Tensor full = p.unsharded.variable_data().view({-1});
    for (int r = 0; r < world; ++r) {
      const int64_t first_row = r * p.chunk_rows;
      const int64_t rows = std::min(p.chunk_rows, p.rows - first_row);
      if (rows <= 0) break;
      full.narrow(0, first_row * p.row_numel, rows * p.row_numel)
          .copy_(gathered.narrow(0, r * flat_numel + p.offset, rows * p.row_numel));
    }
  }
  unsharded = true;
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
  reshard();
}

void FsdpUnit::reduce_scatter_gradients() {
  const at::NoGradGuard no_grad;
  bool any = false;
  for (const auto& p : params) any = any || p.unsharded.grad().defined();
  if (!any) return;
  const auto options_of = at::TensorOptions().dtype(reduce_dtype);
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
    const auto pg = process_group(options.group);
    c10d::ReduceScatterOptions rs;
    rs.reduceOp = c10d::ReduceOp::SUM;
    mdist::wait(pg->reduce_scatter_single(reduced, flat_input, rs), options.group,
                "fully_shard reduce-scatter");
    reduced.div_(world);
  }
  for (auto& p : params) {
    at::Tensor shard_grad = reduced.narrow(0, p.offset, p.shard_numel())
                                .view(p.shard.sizes())
                                .to(shard_dtype, /*non_blocking=*/false, /*copy=*/true);
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
