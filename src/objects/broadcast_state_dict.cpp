// broadcast_state_dict: metadata as an object broadcast, then each tensor's bytes.
#include "mdist/objects/broadcast_state_dict.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "mdist/error.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/c10d.h"
#include "mdist/runtime/runtime.h"
#include "src/runtime/group_state.h"

namespace mdist {
namespace {

// Shape and dtype (c10::ScalarType's value: every rank runs the same libtorch) of one tensor.
using TensorMeta = std::pair<std::vector<int64_t>, int>;

// What src sends first. A non-empty `error` is raised on every rank, so that a bad dict
// fails the collective everywhere instead of leaving the other ranks waiting for tensors.
struct Metadata {
  std::string error;
  std::map<std::string, TensorMeta> tensors;
};

Metadata describe(const std::map<std::string, at::Tensor>* state_dict, int src) {
  Metadata meta;
  if (state_dict == nullptr) {
    meta.error = "src rank " + std::to_string(src) + " passed no state dict to broadcast";
    return meta;
  }
  for (const auto& [name, tensor] : *state_dict) {
    if (!tensor.defined()) {
      meta.error = "tensor '" + name + "' is undefined";
      return meta;
    }
    if (tensor.layout() != c10::kStrided) {
      meta.error = "tensor '" + name + "' is not a strided (dense) tensor";
      return meta;
    }
    meta.tensors.emplace(name,
                         TensorMeta{tensor.sizes().vec(), static_cast<int>(tensor.scalar_type())});
  }
  return meta;
}

// The tensor's bytes as a 1-D uint8 view, so that every dtype (bool, complex, float8, ...)
// travels through any backend unchanged.
at::Tensor bytes_of(const at::Tensor& tensor) {
  return tensor.contiguous().reshape({-1}).view(at::kByte);
}

}  // namespace

std::map<std::string, at::Tensor> broadcast_state_dict(
    const std::map<std::string, at::Tensor>* state_dict, int src, c10::Device device,
    const Group& group) {
  const bool is_src = size() == 1 || rank() == src;
  std::pair<std::string, std::map<std::string, TensorMeta>> sent;
  if (is_src) {
    Metadata meta = describe(state_dict, src);
    sent = {std::move(meta.error), std::move(meta.tensors)};
  }
  const auto [error, tensors] = broadcast(sent, src, group);
  if (!error.empty()) throw Error("mdist: broadcast_state_dict: " + error);

  std::map<std::string, at::Tensor> out;
  if (size() == 1) {
    for (const auto& [name, tensor] : *state_dict) out.emplace(name, tensor.to(device));
    return out;
  }
  const auto pg = process_group(group);
  const std::vector<int> members = group.ranks();
  c10d::BroadcastOptions options;
  // The object broadcast above checked that src is a member.
  options.rootRank =
      static_cast<int64_t>(std::find(members.begin(), members.end(), src) - members.begin());
  options.timeout = group.timeout();
  for (const auto& [name, meta] : tensors) {
    const auto& [shape, dtype] = meta;
    at::Tensor tensor =
        is_src ? state_dict->at(name).to(device)
               : at::empty(
                     shape,
                     at::TensorOptions().dtype(static_cast<c10::ScalarType>(dtype)).device(device));
    if (tensor.numel() > 0) {
      // On src the bytes may be a contiguous copy; the others receive straight into `tensor`.
      std::vector<at::Tensor> wire = {bytes_of(tensor)};
      c10::intrusive_ptr<c10d::Work> work;
      try {
        work = pg->broadcast(wire, options);
      } catch (const std::exception& e) {
        // E.g. a CUDA device on a group without a CUDA backend: said before anything waits.
        throw Error("mdist: broadcast_state_dict: cannot broadcast '" + name + "' on " +
                    device.str() + " over " + group.name() + ": " + detail::first_line(e));
      }
      wait(work, group, "broadcast_state_dict");
    }
    out.emplace(name, std::move(tensor));
  }
  return out;
}

}  // namespace mdist
