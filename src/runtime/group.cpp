// Group handles, new_group, and the checks and error wrapping every collective shares.
#include "mdist/runtime/group.h"

#include <algorithm>
#include <set>
#include <sstream>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "mdist/error.h"
#include "mdist/runtime/c10d.h"
#include "mdist/runtime/runtime.h"
#include "src/runtime/runtime_state.h"

namespace mdist {
namespace detail {
namespace {

std::string ranks_text(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  out << ']';
  return out.str();
}

std::string this_rank_text() {
  const auto& state = runtime_state();
  return state ? "rank " + std::to_string(state->env.rank) : "this process";
}

}  // namespace

std::string GroupState::name() const {
  if (id == 0) return "world";
  return "group " + std::to_string(id) + " " + ranks_text(ranks);
}

std::shared_ptr<GroupState> resolve(const Group& group, const char* op) {
  const auto& runtime = runtime_state();
  switch (group.kind()) {
    case Group::Kind::kNotUsed:
      throw Error(std::string("mdist: ") + op +
                  " on a 'not used' group (the spec's -1); check DistributedProcessGroup::"
                  "is_initialized() first");
    case Group::Kind::kWorld:
      return runtime ? runtime->world : nullptr;
    case Group::Kind::kConcrete:
      break;
  }
  const auto& state = group.state();
  if (state->destroyed || !runtime) {
    throw CommunicationError(std::string("mdist: ") + op + " on " + state->name() +
                             ", which was destroyed by cleanup()");
  }
  if (state->group_rank < 0) {
    throw Error(std::string("mdist: ") + op + " on " + state->name() + ": " + this_rank_text() +
                " is not a member of this group");
  }
  return state;
}

bool is_outside(const Group& group) {
  return group.kind() == Group::Kind::kConcrete && runtime_state() && !group.state()->destroyed &&
         group.state()->group_rank < 0;
}

std::string first_line(const std::exception& error) {
  const auto* const c10_error = dynamic_cast<const c10::Error*>(&error);
  std::string text = c10_error ? c10_error->what_without_backtrace() : error.what();
  text = text.substr(0, text.find('\n'));
  // Gloo and c10d put "[/path/to/file.cc:123] " in front of the message.
  if (text.rfind("[/", 0) == 0) {
    if (const auto close = text.find("] "); close != std::string::npos) text.erase(0, close + 2);
  }
  return text;
}

void wait_work(const c10::intrusive_ptr<c10d::Work>& work, const GroupState& group,
               const char* op) {
  try {
    work->wait();
  } catch (const std::exception& error) {
    throw CommunicationError(std::string("mdist: ") + op + " on " + group.name() + " failed on " +
                             this_rank_text() + " (timeout " +
                             std::to_string(group.timeout.count()) + " ms): " + first_line(error));
  }
}

}  // namespace detail

Group::Group(std::shared_ptr<detail::GroupState> state)
    : kind_(Kind::kConcrete), state_(std::move(state)) {}

Group Group::not_used() { return Group(Kind::kNotUsed); }

bool Group::is_member() const {
  switch (kind_) {
    case Kind::kWorld:
      return true;
    case Kind::kNotUsed:
      return false;
    case Kind::kConcrete:
      return state_->group_rank >= 0;
  }
  return false;
}

std::vector<int> Group::ranks() const {
  switch (kind_) {
    case Kind::kWorld: {
      std::vector<int> all(static_cast<std::size_t>(size()));
      for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
      return all;
    }
    case Kind::kNotUsed:
      return {};
    case Kind::kConcrete:
      return state_->ranks;
  }
  return {};
}

std::string Group::name() const {
  switch (kind_) {
    case Kind::kWorld:
      return "world";
    case Kind::kNotUsed:
      return "not used";
    case Kind::kConcrete:
      return state_->name();
  }
  return "";
}

std::chrono::milliseconds Group::timeout() const {
  if (kind_ == Kind::kConcrete) return state_->timeout;
  return default_timeout();
}

bool operator==(const Group& a, const Group& b) {
  return a.kind_ == b.kind_ && a.state_ == b.state_;
}

std::ostream& operator<<(std::ostream& os, const Group& group) { return os << group.name(); }

Group new_group(std::vector<int> ranks, std::optional<std::chrono::milliseconds> timeout) {
  auto& runtime = detail::runtime_state();
  if (!runtime) throw Error("mdist: new_group needs an initialized job; call setup() first");
  const int world_size = runtime->env.world_size;
  if (ranks.empty()) throw Error("mdist: new_group: the rank list is empty");
  std::set<int> seen;
  for (const int r : ranks) {
    if (r < 0 || r >= world_size) {
      throw Error("mdist: new_group " + detail::ranks_text(ranks) + ": rank " + std::to_string(r) +
                  " is out of range for world size " + std::to_string(world_size));
    }
    if (!seen.insert(r).second) {
      throw Error("mdist: new_group " + detail::ranks_text(ranks) + ": rank " + std::to_string(r) +
                  " appears twice");
    }
  }
  if (timeout && *timeout <= std::chrono::milliseconds(0)) {
    throw Error("mdist: new_group: timeout must be positive");
  }
  auto state = std::make_shared<detail::GroupState>();
  // Every rank calls new_group in the same order, so the counter names the same group
  // everywhere; its store keys live under their own prefix.
  state->id = runtime->next_group_id++;
  state->ranks = std::move(ranks);
  state->timeout = timeout.value_or(runtime->timeout);
  const auto me = std::find(state->ranks.begin(), state->ranks.end(), runtime->env.rank);
  if (me != state->ranks.end()) {
    state->group_rank = static_cast<int>(me - state->ranks.begin());
    const auto prefix = "mdist/group/" + std::to_string(state->id) + "/";
    try {
      state->pg = detail::make_process_group(
          *runtime, c10::make_intrusive<c10d::PrefixStore>(prefix, runtime->store),
          state->group_rank, static_cast<int>(state->ranks.size()), state->timeout, state->name(),
          state->object_device);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& error) {
      throw CommunicationError("mdist: new_group: connecting " + state->name() +
                               " failed on rank " + std::to_string(runtime->env.rank) +
                               " (timeout " + std::to_string(state->timeout.count()) +
                               " ms): " + detail::first_line(error));
    }
  }
  runtime->groups.push_back(state);
  return Group(std::move(state));
}

c10::intrusive_ptr<c10d::ProcessGroup> process_group(const Group& group) {
  const auto state = detail::resolve(group, "process_group");
  if (!state) throw Error("mdist: process_group() needs an initialized job; call setup() first");
  return state->pg;
}

void wait(const c10::intrusive_ptr<c10d::Work>& work, const Group& group, const char* op) {
  const auto state = detail::resolve(group, op);
  if (!state) throw Error(std::string("mdist: ") + op + " needs an initialized job");
  detail::wait_work(work, *state, op);
}

}  // namespace mdist
