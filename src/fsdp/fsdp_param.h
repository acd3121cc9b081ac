#pragma once
// Private: one parameter a fully_shard unit manages (FSDP2's FSDPParam): its dim-0 shard math,
// the shard the module tree registers and the full parameter its forward computes with.
#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace mdist::detail {

// Rank r's real rows [first, first + count) of a parameter: r owns rows [r*c, (r+1)*c) of the
// padded parameter, c = ceil(rows / world), so a rank past the end holds only padding.
struct OwnedRows {
  int64_t first = 0;
  int64_t count = 0;
};

// A tensor held without keeping it alive: a unit must not keep a destroyed model's memory.
class WeakTensor {
 public:
  WeakTensor() = default;
  explicit WeakTensor(const at::Tensor& tensor)
      : impl_(tensor.getIntrusivePtr()), key_(tensor.unsafeGetTensorImpl()) {}
  // The tensor, or an undefined one once nothing else holds it.
  at::Tensor lock() const { return at::Tensor(impl_.lock()); }
  // Its address while alive: the key of lookups by identity.
  const c10::TensorImpl* key() const { return key_; }

 private:
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> impl_{
      c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  const c10::TensorImpl* key_ = nullptr;
};

// Frees a tensor's storage, keeping its TensorImpl (autograd may have saved it).
void free_storage(const at::Tensor& tensor);

class FsdpParam {
 public:
  // `shard`: this rank's padded rows, already registered in place of the parameter; `full`:
  // the module's own tensor, now full-shaped and without storage.
  FsdpParam(std::vector<std::string> names, const at::Tensor& shard, const at::Tensor& full,
            std::vector<int64_t> full_shape, int world, int64_t offset);

  // The names the module tree registers it under, relative to the unit's module; a tied
  // parameter has several, the first is the one state dicts of the unit report.
  const std::vector<std::string>& names() const { return names_; }
  const std::string& name() const { return names_.front(); }
  const std::vector<int64_t>& full_shape() const { return full_shape_; }
  int64_t rows() const { return rows_; }              // full dim 0 (1 for a 0-d parameter)
  int64_t chunk_rows() const { return chunk_rows_; }  // rows per rank, padded
  int64_t row_numel() const { return row_numel_; }
  int64_t shard_numel() const { return chunk_rows_ * row_numel_; }
  int64_t offset() const { return offset_; }  // start in the unit's per-rank flat buffer
  OwnedRows owned(int rank) const {
    const int64_t first = rank * chunk_rows_;
    return {first, std::clamp<int64_t>(rows_ - first, 0, chunk_rows_)};
  }

  // What parameters() yields and the optimizer steps; undefined once the model is gone.
  at::Tensor shard() const { return shard_.lock(); }
  const c10::TensorImpl* shard_key() const { return shard_.key(); }
  // The full parameter forward and backward use (in the compute dtype); undefined once the
  // model is gone.
  at::Tensor full() const { return full_.lock(); }

  // Gives the full parameter storage (on its own device) and the shard's requires_grad, so
  // that freezing the shards after wrapping freezes training.
  void alloc_full() const;
  // On one rank, where the shard is the whole parameter: makes the full parameter use the
  // shard's memory (no copy, no extra memory) when dtype, device and size allow; false, and
  // nothing changed, when they do not.
  bool alias_full() const;
  // Frees the full parameter's storage, or detaches it from the shard's memory when aliased.
  void free_full() const;

 private:
  std::vector<std::string> names_;
  WeakTensor shard_;
  WeakTensor full_;
  std::vector<int64_t> full_shape_;
  int64_t rows_ = 0;
  int64_t chunk_rows_ = 0;
  int64_t row_numel_ = 0;
  int64_t offset_ = 0;
};

}  // namespace mdist::detail
