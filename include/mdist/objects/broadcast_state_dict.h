#pragma once
// The reference's broadcast_state_dict: one rank (typically the one that read a checkpoint)
// sends a dict of tensors to every rank of a group. First the metadata (names, shapes, dtypes)
// travels as one object broadcast, then each tensor through the group's backend on `device`
// (Gloo for CPU tensors, NCCL for CUDA ones), one tensor at a time so that no rank ever holds
// a second copy of the whole dict.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <map>
#include <string>

#include "mdist/runtime/group.h"

namespace mdist {

// Collective over `group`: every member calls it. Global rank `src` (a member of `group`)
// passes its dict; the other ranks pass nullptr (anything they pass is ignored). Returns, on
// every rank, a dict with src's keys, shapes and dtypes on `device`; on src a tensor already on
// `device` is returned as it is (not copied), as the reference's `tensor.to(device)` does.
// Any dtype and layout of strided tensor travels bit for bit (non-contiguous ones arrive
// contiguous). Errors are raised on every rank alike, before any tensor moves: src passing
// nullptr, or an undefined or non-strided (sparse) tensor, names the problem.
// In a world of one process (also when not initialized) it returns the dict moved to `device`.
std::map<std::string, at::Tensor> broadcast_state_dict(
    const std::map<std::string, at::Tensor>* state_dict, int src, c10::Device device,
    const Group& group = Group::world());

}  // namespace mdist
