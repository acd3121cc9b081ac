#pragma once
// Layer 4: parameters without storage, for building a model on the meta device and giving it
// real memory later, piece by piece (e.g. only each rank's shards: see fully_shard).
//
// libtorch cannot move a tensor off the meta device in place: Module::to() and set_data()
// refuse to swap a meta tensor's data for a CPU one, and Python's Module.to_empty() has no C++
// counterpart. A module keeps its parameters twice, in its parameter table and in members such
// as LinearImpl::weight, both handles to one TensorImpl, so replacing the tensor object would
// leave the member stale. These functions change the TensorImpl itself instead: every handle
// sees the new device, shape and storage, and autograd state (requires_grad, version counter)
// is kept. Do not use them on a tensor that already took part in an autograd graph.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/TensorOptions.h>
#include <torch/nn/module.h>

namespace mdist::nn {

// A contiguous tensor of `shape` and `options` whose storage holds 0 bytes (nothing is
// allocated). Its storage keeps the device's allocator, so it can be grown later. Reading or
// writing its elements is undefined until then; only the metadata (sizes, dtype, device) is
// usable.
at::Tensor storageless(at::IntArrayRef shape, const at::TensorOptions& options);

// Makes `tensor` take `source`'s storage, shape, strides, dtype and device, in place (unlike
// Tensor::set_data, also from or to the meta device). Both must be dense tensors.
void assign_in_place(const at::Tensor& tensor, const at::Tensor& source);

// Every parameter and buffer of `module` (and, with recurse, of its submodules) becomes a meta
// tensor of the same shape and dtype, in place: its memory is released.
void to_meta(torch::nn::Module& module, bool recurse = true);

// Every meta parameter and buffer of `module` and its submodules becomes an uninitialised
// tensor of its shape and dtype on `device`, in place (Python's Module.to_empty, restricted to
// meta tensors; the others are left as they are). Allocates the full size of each.
void to_empty(torch::nn::Module& module, c10::Device device);

// True if any parameter or buffer of `module` or its submodules is on the meta device.
bool has_meta_tensors(const torch::nn::Module& module);

}  // namespace mdist::nn
