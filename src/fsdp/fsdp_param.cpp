// FsdpParam: growing and shrinking the full parameter's storage in place.
#include "src/fsdp/fsdp_param.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>

#include <utility>

namespace mdist::detail {

void free_storage(const at::Tensor& tensor) {
  c10::StorageImpl* const storage = tensor.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
}

FsdpParam::FsdpParam(std::vector<std::string> names, const at::Tensor& shard,
                     const at::Tensor& full, std::vector<int64_t> full_shape, int world,
                     int64_t offset)
    : names_(std::move(names)),
      shard_(shard),
      full_(full),
      full_shape_(std::move(full_shape)),
      rows_(full_shape_.empty() ? 1 : full_shape_.front()),
      chunk_rows_((rows_ + world - 1) / world),
      row_numel_(rows_ > 0 ? full.numel() / rows_ : 0),
      offset_(offset) {}

void FsdpParam::alloc_full() const {
  const at::Tensor tensor = full();
  const at::Tensor owner = shard();
  if (!tensor.defined() || !owner.defined()) return;
  // The full parameter keeps its TensorImpl (autograd saved it for backward); only its
  // storage grows and shrinks, so the memory is really released between uses.
  c10::StorageImpl* const storage = tensor.storage().unsafeGetStorageImpl();
  const auto nbytes = static_cast<std::size_t>(tensor.numel()) * tensor.element_size();
  if (storage->nbytes() < nbytes) {
    // The allocator (CUDA's caching one) allocates on the current device, which need not be
    // the tensor's.
    const c10::OptionalDeviceGuard guard(tensor.device());
    storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
    storage->set_nbytes(nbytes);
  }
  if (tensor.requires_grad() != owner.requires_grad()) {
    // Through the tensor's own impl: requires_grad_ on a const Tensor is fine for a leaf.
    at::Tensor leaf = tensor;
    leaf.set_requires_grad(owner.requires_grad());
  }
}

void FsdpParam::free_full() const {
  if (const at::Tensor tensor = full(); tensor.defined()) free_storage(tensor);
}

}  // namespace mdist::detail
