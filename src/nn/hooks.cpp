#include "mdist/nn/hooks.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace mdist::nn {
namespace {

struct ModuleHooks {
  // Hooks are keyed by address; a dead module's address can be reused by a new module, which
  // must not inherit them.
  std::weak_ptr<const torch::nn::Module> owner;
  bool owner_tracked = false;
  std::vector<std::pair<std::uint64_t, ForwardPreHook>> pre;
  std::vector<std::pair<std::uint64_t, ForwardHook>> post;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, ModuleHooks> hooks;
  std::uint64_t next_id = 1;
  std::atomic<std::size_t> count{0};  // hooks registered anywhere: the fast path reads this
};

Registry& registry() {
  static Registry instance;
  return instance;
}

// The live hooks of `module`; drops those left behind by a dead module. Caller holds the lock.
ModuleHooks* live_hooks(Registry& r, const torch::nn::Module& module) {
  const auto it = r.hooks.find(&module);
  if (it == r.hooks.end()) return nullptr;
  if (it->second.owner_tracked && it->second.owner.expired()) {
    r.count -= it->second.pre.size() + it->second.post.size();
    r.hooks.erase(it);
    return nullptr;
  }
  return &it->second;
}

ModuleHooks& hooks_for_new(Registry& r, torch::nn::Module& module) {
  if (ModuleHooks* const hooks = live_hooks(r, module)) return *hooks;
  ModuleHooks& hooks = r.hooks[&module];
  try {
    hooks.owner = module.shared_from_this();
    hooks.owner_tracked = true;
  } catch (const std::bad_weak_ptr&) {
    // Not owned by a shared_ptr: the hooks stay until removed.
  }
  return hooks;
}

// Hooks run outside the lock (a hook may register or remove hooks); copies keep them alive.
ModuleHooks snapshot(const torch::nn::Module& module) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  const ModuleHooks* const hooks = live_hooks(r, module);
  return hooks ? *hooks : ModuleHooks();
}

}  // namespace

void HookHandle::remove() {
  if (module_ == nullptr) return;
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  const auto it = r.hooks.find(module_);
  if (it != r.hooks.end()) {
    auto& hooks = it->second;
    const auto erase = [&](auto& list) {
      const auto before = list.size();
      std::erase_if(list, [&](const auto& entry) { return entry.first == id_; });
      r.count -= before - list.size();
    };
    erase(hooks.pre);
    erase(hooks.post);
    if (hooks.pre.empty() && hooks.post.empty()) r.hooks.erase(it);
  }
  module_ = nullptr;
}

namespace {

// Adds `hook` to `module`'s pre- or post-hook list (`list` selects which).
template <class Hook>
HookHandle add_hook(torch::nn::Module& module, Hook hook,
                    std::vector<std::pair<std::uint64_t, Hook>> ModuleHooks::*list) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  const auto id = r.next_id++;
  (hooks_for_new(r, module).*list).emplace_back(id, std::move(hook));
  ++r.count;
  return {&module, id};
}

}  // namespace

HookHandle register_forward_pre_hook(torch::nn::Module& module, ForwardPreHook hook) {
  return add_hook(module, std::move(hook), &ModuleHooks::pre);
}

HookHandle register_forward_hook(torch::nn::Module& module, ForwardHook hook) {
  return add_hook(module, std::move(hook), &ModuleHooks::post);
}

bool has_hooks(const torch::nn::Module& module) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  return live_hooks(r, module) != nullptr;
}

namespace detail {

bool any_hooks() { return registry().count.load(std::memory_order_relaxed) != 0; }

void run_pre_hooks(torch::nn::Module& module, TensorRefs& inputs) {
  for (auto& [id, hook] : snapshot(module).pre) hook(module, inputs);
}

void run_post_hooks(torch::nn::Module& module, TensorRefs& outputs) {
  for (auto& [id, hook] : snapshot(module).post) hook(module, outputs);
}

}  // namespace detail
}  // namespace mdist::nn
