#pragma once
// Private: per-module state kept beside torch::nn::Module, which has no slot for it.
//
// Entries are keyed by the module's address. A dead module's address can be reused by a new
// module, which must not inherit the old one's state, so an entry remembers (weakly) the
// module that owns it when that module is held by a shared_ptr, and is dropped as soon as a
// lookup finds that owner gone. A module not owned by a shared_ptr cannot be tracked: its
// entry lives until it is erased. Not thread-safe: callers hold their own lock.
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <unordered_map>
#include <utility>

namespace mdist::nn::detail {

template <class Value>
class ModuleRegistry {
 public:
  // `on_drop` sees each value removed because its module died (not those erased explicitly).
  explicit ModuleRegistry(std::function<void(Value&)> on_drop = {})
      : on_drop_(std::move(on_drop)) {}

  // The live entry of `module`, or null.
  Value* find(const torch::nn::Module& module) {
    const auto it = entries_.find(&module);
    if (it == entries_.end()) return nullptr;
    if (it->second.dead()) {
      drop(it);
      return nullptr;
    }
    return &it->second.value;
  }

  // The live entry of `module`, made (default-constructed) when there is none.
  Value& find_or_add(torch::nn::Module& module) {
    if (Value* const value = find(module)) return *value;
    Entry entry;
    try {
      entry.owner = module.shared_from_this();
      entry.tracked = true;
    } catch (const std::bad_weak_ptr&) {
      // Not owned by a shared_ptr: the entry stays until erased.
    }
    return entries_.emplace(&module, std::move(entry)).first->second.value;
  }

  void erase(const torch::nn::Module& module) { entries_.erase(&module); }

  // Drops the entries of every dead module.
  void sweep() {
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->second.dead()) {
        it = drop(it);
      } else {
        ++it;
      }
    }
  }

 private:
  struct Entry {
    std::weak_ptr<const torch::nn::Module> owner;
    bool tracked = false;
    Value value{};
    bool dead() const { return tracked && owner.expired(); }
  };
  using Map = std::unordered_map<const torch::nn::Module*, Entry>;

  typename Map::iterator drop(typename Map::iterator it) {
    if (on_drop_) on_drop_(it->second.value);
    return entries_.erase(it);
  }

  Map entries_;
  std::function<void(Value&)> on_drop_;
};

}  // namespace mdist::nn::detail
