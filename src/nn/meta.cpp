// Building modules without storage and giving them real memory in place (see meta.h).
#include "mdist/nn/meta.h"

#include <ATen/ATen.h>

#include "mdist/error.h"

namespace mdist::nn {

at::Tensor storageless(at::IntArrayRef shape, const at::TensorOptions& options) {
  at::Tensor tensor = at::empty({0}, options);
  // Sizes without the storage to back them: the state fully_shard leaves a resharded full
  // parameter in, and what it grows again on unshard.
  tensor.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return tensor;
}

void assign_in_place(const at::Tensor& tensor, const at::Tensor& source) {
  if (!tensor.defined() || !source.defined()) {
    throw Error("mdist::nn::assign_in_place: both tensors must be defined");
  }
  if (tensor.layout() != at::kStrided || source.layout() != at::kStrided) {
    throw Error("mdist::nn::assign_in_place: only dense (strided) tensors can be assigned");
  }
  if (tensor.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) return;
  // What set_data does after its same-backend check: the TensorImpl takes the source's
  // storage, sizes, dtype, device and dispatch keys; autograd metadata and the version
  // counter stay the tensor's own.
  tensor.unsafeGetTensorImpl()->shallow_copy_from(source.getIntrusivePtr());
}

namespace {

template <typename Fn>
void for_each_tensor(torch::nn::Module& module, bool recurse, const Fn& fn) {
  for (const auto& tensor : module.parameters(recurse)) fn(tensor);
  for (const auto& tensor : module.buffers(recurse)) fn(tensor);
}

}  // namespace

void to_meta(torch::nn::Module& module, bool recurse) {
  for_each_tensor(module, recurse, [](const at::Tensor& tensor) {
    if (!tensor.is_meta()) {
      assign_in_place(tensor, at::empty(tensor.sizes(), tensor.options().device(c10::kMeta)));
    }
  });
}

void to_empty(torch::nn::Module& module, c10::Device device) {
  for_each_tensor(module, /*recurse=*/true, [&](const at::Tensor& tensor) {
    if (tensor.is_meta()) {
      assign_in_place(tensor, at::empty(tensor.sizes(), tensor.options().device(device)));
    }
  });
}

bool has_meta_tensors(const torch::nn::Module& module) {
  for (const auto& tensor : module.parameters()) {
    if (tensor.is_meta()) return true;
  }
  for (const auto& tensor : module.buffers()) {
    if (tensor.is_meta()) return true;
  }
  return false;
}

}  // namespace mdist::nn
