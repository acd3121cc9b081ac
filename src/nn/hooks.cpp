#include "mdist/nn/hooks.h"

#include <atomic>
#include <mutex>

#include "src/nn/module_registry.h"

namespace mdist::nn {
namespace {

template <class Hook>
using HookList = std::vector<std::pair<std::uint64_t, Hook>>;

struct ModuleHooks {
  HookList<ForwardPreHook> pre;
  HookList<ForwardHook> post;
  HookList<ForwardErrorHook> error;
  std::size_t size() const { return pre.size() + post.size() + error.size(); }
};

struct Registry {
  std::mutex mutex;
  std::atomic<std::size_t> count{0};  // hooks registered anywhere: the fast path reads this
  // A dead module's hooks are dropped at the next lookup of its address.
  detail::ModuleRegistry<ModuleHooks> hooks{
      [this](ModuleHooks& dropped) { count -= dropped.size(); }};
  std::uint64_t next_id = 1;
};

Registry& registry() {
  static Registry instance;
  return instance;
}

// Hooks run outside the lock (a hook may register or remove hooks); copies keep them alive.
ModuleHooks snapshot(const torch::nn::Module& module) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  const ModuleHooks* const hooks = r.hooks.find(module);
  return hooks ? *hooks : ModuleHooks();
}

// Adds `hook` to one of `module`'s lists (`list` selects which).
template <class Hook>
HookHandle add_hook(torch::nn::Module& module, Hook hook, HookList<Hook> ModuleHooks::*list) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  const auto id = r.next_id++;
  (r.hooks.find_or_add(module).*list).emplace_back(id, std::move(hook));
  ++r.count;
  return {&module, id};
}

}  // namespace

void HookHandle::remove() {
  if (module_ == nullptr) return;
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  if (ModuleHooks* const hooks = r.hooks.find(*module_)) {
    const auto erase = [&](auto& list) {
      const auto before = list.size();
      std::erase_if(list, [&](const auto& entry) { return entry.first == id_; });
      r.count -= before - list.size();
    };
    erase(hooks->pre);
    erase(hooks->post);
    erase(hooks->error);
    if (hooks->size() == 0) r.hooks.erase(*module_);
  }
  module_ = nullptr;
}

HookHandle register_forward_pre_hook(torch::nn::Module& module, ForwardPreHook hook) {
  return add_hook(module, std::move(hook), &ModuleHooks::pre);
}

HookHandle register_forward_hook(torch::nn::Module& module, ForwardHook hook) {
  return add_hook(module, std::move(hook), &ModuleHooks::post);
}

HookHandle register_forward_error_hook(torch::nn::Module& module, ForwardErrorHook hook) {
  return add_hook(module, std::move(hook), &ModuleHooks::error);
}

bool has_hooks(const torch::nn::Module& module) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  return r.hooks.find(module) != nullptr;
}

namespace detail {

bool any_hooks() { return registry().count.load(std::memory_order_relaxed) != 0; }

void run_pre_hooks(torch::nn::Module& module, TensorRefs& inputs) {
  for (auto& [id, hook] : snapshot(module).pre) hook(module, inputs);
}

void run_post_hooks(torch::nn::Module& module, TensorRefs& outputs) {
  for (auto& [id, hook] : snapshot(module).post) hook(module, outputs);
}

void run_error_hooks(torch::nn::Module& module) noexcept {
  for (auto& [id, hook] : snapshot(module).error) hook(module);
}

}  // namespace detail
}  // namespace mdist::nn
