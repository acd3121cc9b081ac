#pragma once
// Object collectives: any value the codec (codec.h) supports, sizes free to differ per rank.
//
// Not initialized, or a group of one rank: each returns its input (allgather: {obj}), as the
// spec says; broadcast returns its input in a world of one whatever its source. A "not used"
// group, or a group this process is not in, is an Error (the reference fails there too, less
// clearly); a peer that fails or does not arrive within the group's timeout is a
// CommunicationError.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "mdist/objects/codec.h"
#include "mdist/runtime/group.h"
#include "mdist/runtime/runtime.h"

namespace mdist {

namespace detail {
// Byte-level transport (src/objects/byte_collectives.cpp): sizes first, then one all-gather
// (or broadcast) of a padded buffer through the group's CPU (Gloo) or CUDA backend.
std::vector<std::vector<std::uint8_t>> allgather_bytes(std::span<const std::uint8_t> bytes,
                                                       const Group& group, const char* op);
std::vector<std::uint8_t> broadcast_bytes(std::span<const std::uint8_t> bytes, int src,
                                          const Group& group);
// Size of `group` for the collective `op`; its errors name `op`.
int group_size(const Group& group, const char* op);
// Checks `src` (a global rank) is a member of `group`; returns its rank in the group.
int check_broadcast_source(int src, const Group& group);

// Elementwise sum / max / min of tensors of one shape (src/objects/byte_collectives.cpp).
at::Tensor reduce_tensors(const std::vector<at::Tensor>& values, std::string_view op);

template <class T>
T sum_of(const std::vector<T>& values) {
  T total = values.front();
  for (std::size_t i = 1; i < values.size(); ++i) total = total + values[i];
  return total;
}
}  // namespace detail

// Every rank gets `obj` as sent by global rank `src` (a member of `group`), like
// torch.distributed's broadcast with a global source rank. As the reference, a world of one
// process (also not initialized) returns `obj` whatever `src` and `group` are.
template <class T>
T broadcast(const T& obj, int src = 0, const Group& group = Group::world()) {
  if (size() == 1) return obj;
  detail::check_broadcast_source(src, group);
  if (detail::group_size(group, "broadcast") == 1) return obj;
  const auto bytes = rank() == src ? to_bytes(obj) : std::vector<std::uint8_t>();
  const auto received = detail::broadcast_bytes(bytes, src, group);
  if (rank() == src) return obj;
  return from_bytes<T>(received);
}

namespace detail {
template <class T>
std::vector<T> allgather_as(const T& obj, const Group& group, const char* op) {
  if (group_size(group, op) == 1) return {obj};
  const auto gathered = allgather_bytes(to_bytes(obj), group, op);
  std::vector<T> result;
  result.reserve(gathered.size());
  for (const auto& bytes : gathered) result.push_back(from_bytes<T>(bytes));
  return result;
}
}  // namespace detail

// Every rank's `obj`, in group-rank order.
template <class T>
std::vector<T> allgather(const T& obj, const Group& group = Group::world()) {
  return detail::allgather_as(obj, group, "allgather");
}

// Gathers every rank's `obj` and reduces them in rank order with `op`: "sum" (operator+),
// "max" or "min" (operator<); tensors elementwise. The same result on every rank.
template <class T>
T allreduce(const T& obj, std::string_view op = "sum", const Group& group = Group::world()) {
  if (op != "sum" && op != "max" && op != "min") {
    throw Error("mdist: allreduce: unsupported op '" + std::string(op) +
                "' (supported: sum, max, min)");
  }
  const auto values = detail::allgather_as(obj, group, "allreduce");
  if constexpr (std::is_same_v<T, at::Tensor>) {
    return detail::reduce_tensors(values, op);
  } else if (op == "sum") {
    if constexpr (requires(const T& a) { a + a; }) {
      return detail::sum_of(values);
    } else {
      throw Error("mdist: allreduce: op 'sum' needs a type with operator+");
    }
  }
  if constexpr (requires(const T& a) {
                  { a < a } -> std::convertible_to<bool>;
                }) {
    return op == "max" ? *std::max_element(values.begin(), values.end())
                       : *std::min_element(values.begin(), values.end());
  } else {
    throw Error("mdist: allreduce: op '" + std::string(op) + "' needs a type with operator<");
  }
}

// Runs `fn` on the group's master (group rank 0) only and gives its result to every rank.
template <class F>
auto master_only(F&& fn, const Group& group = Group::world()) {
  using R = std::invoke_result_t<F>;
  const int master = group.is_world() ? 0 : group.ranks().at(0);
  if constexpr (std::is_void_v<R>) {
    if (is_master(group)) std::invoke(std::forward<F>(fn));
    barrier(group);
  } else {
    std::optional<R> result;
    if (is_master(group)) result.emplace(std::invoke(std::forward<F>(fn)));
    return broadcast(result, master, group).value();
  }
}

}  // namespace mdist
