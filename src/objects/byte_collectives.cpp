// The byte transport under the object collectives.
#include <ATen/ATen.h>

#include <cstring>

#include "mdist/error.h"
#include "mdist/objects/collectives.h"
#include "src/runtime/group_state.h"

namespace mdist::detail {
namespace {

at::Tensor byte_tensor(std::span<const std::uint8_t> bytes, std::int64_t padded_size,
                       const c10::Device& device) {
  at::Tensor host = at::zeros({padded_size}, at::TensorOptions().dtype(at::kByte));
  if (!bytes.empty()) std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
  return host.to(device);
}

}  // namespace

at::Tensor reduce_tensors(const std::vector<at::Tensor>& values, std::string_view op) {
  at::Tensor result = values.front().clone();
  for (std::size_t i = 1; i < values.size(); ++i) {
    if (!values[i].sizes().equals(result.sizes())) {
      throw Error("mdist: allreduce: tensors of shapes " + c10::str(result.sizes()) + " and " +
                  c10::str(values[i].sizes()) + " (from group rank " + std::to_string(i) +
                  ") cannot be reduced together");
    }
    if (op == "sum") {
      result.add_(values[i]);
    } else if (op == "max") {
      result = at::maximum(result, values[i]);
    } else {
      result = at::minimum(result, values[i]);
    }
  }
  return result;
}

int group_size(const Group& group, const char* op) {
  const auto state = resolve(group, op);
  return state ? static_cast<int>(state->ranks.size()) : 1;
}

int check_broadcast_source(int src, const Group& group) {
  const auto members = group.is_not_used() ? std::vector<int>() : group.ranks();
  if (group.is_not_used()) resolve(group, "broadcast");  // throws the 'not used' error
  const auto it = std::find(members.begin(), members.end(), src);
  if (it == members.end()) {
    if (group.is_world()) {
      throw Error("mdist: broadcast: src " + std::to_string(src) +
                  " is out of range for the world of size " + std::to_string(members.size()));
    }
    throw Error("mdist: broadcast: src " + std::to_string(src) + " is not a member of " +
                group.name());
  }
  return static_cast<int>(it - members.begin());
}

namespace {

// Small objects (the common case: an amax, a flag, a short record) travel in one collective:
// each rank's slot carries its length and, when it fits, its bytes. Only a larger object
// costs a second collective with the exact longest size.
constexpr std::int64_t kInlineBytes = 504;
constexpr std::int64_t kSlotBytes = 8 + kInlineBytes;

at::Tensor slot_of(std::span<const std::uint8_t> bytes, const c10::Device& device) {
  at::Tensor slot = at::zeros({kSlotBytes}, at::TensorOptions().dtype(at::kByte));
  const auto length = static_cast<std::int64_t>(bytes.size());
  auto* const data = slot.data_ptr<std::uint8_t>();
  std::memcpy(data, &length, sizeof(length));
  if (length <= kInlineBytes && length > 0) std::memcpy(data + 8, bytes.data(), bytes.size());
  return slot.to(device);
}

std::int64_t slot_length(const std::uint8_t* slot, const char* op, std::int64_t rank) {
  std::int64_t length = 0;
  std::memcpy(&length, slot, sizeof(length));
  if (length < 0) {
    throw DecodeError("mdist: " + std::string(op) + ": rank " + std::to_string(rank) +
                      " announced an invalid object size " + std::to_string(length));
  }
  return length;
}

}  // namespace

std::vector<std::vector<std::uint8_t>> allgather_bytes(std::span<const std::uint8_t> bytes,
                                                       const Group& group, const char* op) {
  const auto state = resolve(group, op);
  if (!state) return {std::vector<std::uint8_t>(bytes.begin(), bytes.end())};
  const auto world = static_cast<std::int64_t>(state->ranks.size());
  const auto device = state->object_device;
  auto& pg = *state->pg;

  at::Tensor my_slot = slot_of(bytes, device);
  at::Tensor slots =
      at::empty({world * kSlotBytes}, at::TensorOptions().dtype(at::kByte).device(device));
  wait_work(pg.all_gather_single(slots, my_slot), *state, op);
  slots = slots.to(c10::kCPU);
  const auto* const slot_data = slots.data_ptr<std::uint8_t>();
  std::vector<std::int64_t> length(static_cast<std::size_t>(world));
  for (std::int64_t r = 0; r < world; ++r) {
    length[static_cast<std::size_t>(r)] = slot_length(slot_data + r * kSlotBytes, op, r);
  }
  const std::int64_t longest = *std::max_element(length.begin(), length.end());

  std::vector<std::vector<std::uint8_t>> result(static_cast<std::size_t>(world));
  if (longest <= kInlineBytes) {
    for (std::int64_t r = 0; r < world; ++r) {
      const auto* const begin = slot_data + r * kSlotBytes + 8;
      result[static_cast<std::size_t>(r)].assign(begin,
                                                 begin + length[static_cast<std::size_t>(r)]);
    }
    return result;
  }
  at::Tensor input = byte_tensor(bytes, longest, device);
  at::Tensor output =
      at::empty({world * longest}, at::TensorOptions().dtype(at::kByte).device(device));
  wait_work(pg.all_gather_single(output, input), *state, op);
  output = output.to(c10::kCPU);
  const auto* const data = output.data_ptr<std::uint8_t>();
  for (std::int64_t r = 0; r < world; ++r) {
    const auto* const begin = data + r * longest;
    result[static_cast<std::size_t>(r)].assign(begin, begin + length[static_cast<std::size_t>(r)]);
  }
  return result;
}

std::vector<std::uint8_t> broadcast_bytes(std::span<const std::uint8_t> bytes, int src,
                                          const Group& group) {
  const auto state = resolve(group, "broadcast");
  if (!state) return {bytes.begin(), bytes.end()};
  const int group_src = check_broadcast_source(src, group);
  const auto device = state->object_device;
  auto& pg = *state->pg;
  c10d::BroadcastOptions options;
  options.rootRank = group_src;
  options.timeout = state->timeout;
  const bool is_source = state->group_rank == group_src;

  std::vector<at::Tensor> slot = {
      is_source ? slot_of(bytes, device)
                : at::empty({kSlotBytes}, at::TensorOptions().dtype(at::kByte).device(device))};
  wait_work(pg.broadcast(slot, options), *state, "broadcast");
  const at::Tensor host_slot = slot[0].to(c10::kCPU);
  const auto* const slot_data = host_slot.data_ptr<std::uint8_t>();
  const std::int64_t length = slot_length(slot_data, "broadcast", group_src);
  if (length <= kInlineBytes) return {slot_data + 8, slot_data + 8 + length};

  std::vector<at::Tensor> data = {
      is_source ? byte_tensor(bytes, length, device)
                : at::empty({length}, at::TensorOptions().dtype(at::kByte).device(device))};
  wait_work(pg.broadcast(data, options), *state, "broadcast");
  const at::Tensor host = data[0].to(c10::kCPU);
  const auto* const begin = host.data_ptr<std::uint8_t>();
  return {begin, begin + length};
}

}  // namespace mdist::detail
