#pragma once
// A handle to a communication group, as the spec's `group` argument: the world (None), not
// used (-1), or a concrete subgroup made by new_group(). Cheap to copy; no torch headers.
#include <chrono>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace mdist {

namespace detail {
struct GroupState;  // the c10d process group behind a concrete group (src/runtime)
}

class Group {
 public:
  enum class Kind { kWorld, kNotUsed, kConcrete };

  // The default-constructed group is the world, like the spec's `group=None`.
  Group() = default;
  static Group world() { return Group(); }
  // The spec's -1: a parallelism that this job does not use.
  static Group not_used();

  Kind kind() const { return kind_; }
  bool is_world() const { return kind_ == Kind::kWorld; }
  bool is_not_used() const { return kind_ == Kind::kNotUsed; }

  // Whether this process belongs to the group. The world always holds it; "not used" never.
  bool is_member() const;
  // Global ranks of the members in group-rank order (the world: 0..size()-1).
  std::vector<int> ranks() const;
  // "world", "not used" or "group 3 [0, 2]".
  std::string name() const;
  // Timeout of the group's collectives.
  std::chrono::milliseconds timeout() const;

  friend bool operator==(const Group& a, const Group& b);

  // For the layers above (fsdp): the state of a concrete group.
  const std::shared_ptr<detail::GroupState>& state() const { return state_; }
  explicit Group(std::shared_ptr<detail::GroupState> state);

 private:
  explicit Group(Kind kind) : kind_(kind) {}
  Kind kind_ = Kind::kWorld;
  std::shared_ptr<detail::GroupState> state_;
};

std::ostream& operator<<(std::ostream& os, const Group& group);

// Makes a group of the given global ranks (order kept: rank i of the group is ranks[i]).
// Collective over the world: every rank calls it with the same arguments, members and
// non-members alike, in the same order as other new_group calls. Non-members get a handle
// whose is_member() is false. Throws Error on empty, duplicate or out-of-range ranks.
Group new_group(std::vector<int> ranks,
                std::optional<std::chrono::milliseconds> timeout = std::nullopt);

}  // namespace mdist
