// FsdpParam: growing and shrinking the full parameter's storage in place.
#include "src/fsdp/fsdp_param.h"

#include <c10/core/Allocator.h>
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

namespace {

bool shares_storage(const at::Tensor& a, const at::Tensor& b) {
  return a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl();
}

void match_requires_grad(const at::Tensor& tensor, const at::Tensor& owner) {
  if (tensor.requires_grad() != owner.requires_grad()) {
    // Through the tensor's own impl: requires_grad_ on a const Tensor is fine for a leaf.
    at::Tensor leaf = tensor;
    leaf.set_requires_grad(owner.requires_grad());
  }
}

}  // namespace

void FsdpParam::alloc_full() const {
  const at::Tensor tensor = full();
  const at::Tensor owner = shard();
  if (!tensor.defined() || !owner.defined()) return;
  if (shares_storage(tensor, owner)) free_full();  // an alias must not be written through
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
  match_requires_grad(tensor, owner);
}

bool FsdpParam::alias_full() const {
  const at::Tensor tensor = full();
  const at::Tensor owner = shard();
  if (!tensor.defined() || !owner.defined()) return false;
  if (shares_storage(tensor, owner)) return true;
  if (owner.scalar_type() != tensor.scalar_type() || owner.device() != tensor.device() ||
      owner.numel() != tensor.numel() || !owner.is_contiguous() || !tensor.is_contiguous()) {
    return false;
  }
  // The TensorImpl autograd saved stays; it now points at the shard's storage. Its own
  // (storage-less) storage is dropped and replaced by a fresh empty one in free_full.
  c10::TensorImpl* const impl = tensor.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(owner.storage());
  impl->set_storage_offset(owner.storage_offset());
  match_requires_grad(tensor, owner);
  return true;
}

void FsdpParam::free_full() const {
  const at::Tensor tensor = full();
  if (!tensor.defined()) return;
  const at::Tensor owner = shard();
  if (owner.defined() && shares_storage(tensor, owner)) {
    // Freeing the shared storage would free the shard: give the full parameter an empty
    // storage of its own again.
    c10::TensorImpl* const impl = tensor.unsafeGetTensorImpl();
    const c10::OptionalDeviceGuard guard(tensor.device());  // an empty allocation's device
    impl->set_storage_keep_dtype(c10::Storage(c10::Storage::use_byte_size_t(), 0,
                                              c10::GetAllocator(tensor.device().type()),
                                              /*resizable=*/true));
    impl->set_storage_offset(0);
    return;
  }
  free_storage(tensor);
}

}  // namespace mdist::detail
