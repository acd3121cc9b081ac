#pragma once
// Layer 4: forward hooks for libtorch modules.
//
// torch::nn::Module has no hooks, and a parent calls its children's forward() directly, so
// nothing can step in between. mdist's interception point is a call helper: modules that
// want their submodules to be hookable (FSDP wraps them) call them through mdist::nn::call
//
//     x = mdist::nn::call(fc1, x);        // instead of fc1(x) or fc1->forward(x)
//
// and a module whose own forward should run its hooks when a user calls it directly writes
//
//     at::Tensor forward(const at::Tensor& x) { return mdist::nn::hooked(*this, &Impl::body, x); }
//
// With no hook registered anywhere a call costs one relaxed atomic load; with hooks elsewhere,
// one hash lookup. Hooks see the call's tensors (arguments, then results) by reference and may
// replace them, e.g. to cast inputs or to attach autograd nodes to outputs. When the forward
// (or a forward hook) throws after the pre-hooks ran, the module's error hooks run before the
// exception goes on, so that state a pre-hook set up (FSDP's gathered parameters) is undone.
#include <ATen/core/Tensor.h>
#include <ATen/ops/linear.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace mdist::nn {

// The tensors of a call's arguments or of its result, in order, by reference.
using TensorRefs = std::vector<at::Tensor*>;
using ForwardPreHook = std::function<void(torch::nn::Module& module, TensorRefs& inputs)>;
using ForwardHook = std::function<void(torch::nn::Module& module, TensorRefs& outputs)>;
using ForwardErrorHook = std::function<void(torch::nn::Module& module)>;

// Removes its hook on remove() (not on destruction: hooks usually live as long as the module).
class HookHandle {
 public:
  HookHandle() = default;
  HookHandle(const torch::nn::Module* module, std::uint64_t id) : module_(module), id_(id) {}
  void remove();

 private:
  const torch::nn::Module* module_ = nullptr;
  std::uint64_t id_ = 0;
};

HookHandle register_forward_pre_hook(torch::nn::Module& module, ForwardPreHook hook);
HookHandle register_forward_hook(torch::nn::Module& module, ForwardHook hook);
// Runs when the forward or a forward hook throws after the pre-hooks ran; it must not throw.
HookHandle register_forward_error_hook(torch::nn::Module& module, ForwardErrorHook hook);
bool has_hooks(const torch::nn::Module& module);

namespace detail {
bool any_hooks();
void run_pre_hooks(torch::nn::Module& module, TensorRefs& inputs);
void run_post_hooks(torch::nn::Module& module, TensorRefs& outputs);
void run_error_hooks(torch::nn::Module& module) noexcept;

// Collects the tensors inside a value: a tensor, a vector of tensors, a tuple or pair of such.
// Declared first, so that the tuple and pair overloads (templates, looked up where they are
// defined) see it for their non-tensor members, e.g. a pointer argument.
template <class T>
void collect(TensorRefs&, T&) {}  // anything else carries no tensor
inline void collect(TensorRefs& refs, at::Tensor& tensor) { refs.push_back(&tensor); }
inline void collect(TensorRefs& refs, std::vector<at::Tensor>& tensors) {
  for (auto& tensor : tensors) refs.push_back(&tensor);
}
template <class... Ts>
void collect(TensorRefs& refs, std::tuple<Ts...>& values) {
  std::apply([&](auto&... value) { (collect(refs, value), ...); }, values);
}
template <class A, class B>
void collect(TensorRefs& refs, std::pair<A, B>& values) {
  collect(refs, values.first);
  collect(refs, values.second);
}

template <class M>
torch::nn::Module& base_of(M& module) {
  return static_cast<torch::nn::Module&>(module);
}

// The module whose hooked call is running on this thread. A module whose forward is itself
// hooked() and that its parent reaches through call() would otherwise run its hooks twice.
inline thread_local const torch::nn::Module* hooks_running_for = nullptr;

class HooksRunningFor {
 public:
  explicit HooksRunningFor(const torch::nn::Module& module) : saved_(hooks_running_for) {
    hooks_running_for = &module;
  }
  ~HooksRunningFor() { hooks_running_for = saved_; }
  HooksRunningFor(const HooksRunningFor&) = delete;
  HooksRunningFor& operator=(const HooksRunningFor&) = delete;

 private:
  const torch::nn::Module* saved_;
};

// Runs `invoke(args...)` for `module` with its hooks around it. The arguments are copied
// into a tuple only when hooks exist, so that pre-hooks can replace tensors in it.
template <class R, class Invoke, class... Args>
R run_with_hooks(torch::nn::Module& module, Invoke&& invoke, Args&&... args) {
  if (!any_hooks() || hooks_running_for == &module || !has_hooks(module)) {
    return invoke(std::forward<Args>(args)...);
  }
  const HooksRunningFor running(module);
  std::tuple<std::decay_t<Args>...> arguments(std::forward<Args>(args)...);
  TensorRefs inputs;
  collect(inputs, arguments);
  run_pre_hooks(module, inputs);
  try {
    R result = std::apply([&](auto&... a) -> R { return invoke(a...); }, arguments);
    TensorRefs outputs;
    collect(outputs, result);
    run_post_hooks(module, outputs);
    return result;
  } catch (...) {
    run_error_hooks(module);
    throw;
  }
}

// A module's forward. A Linear computes as PyTorch's nn.Linear does (at::linear), not as
// libtorch's LinearImpl::forward (torch::nn::functional::linear), which for an input of more
// than 2 dims with a bias runs matmul, then adds the bias: the product is rounded to the
// input's dtype before the bias is added, where at::linear's addmm over the flattened rows
// rounds once. Bit-identical in fp32; in bf16 a different result in about a third of the
// elements, the first difference of mdist's bf16 forward from PyTorch's
// (docs/quantization.md, "bf16 compute"). The weight and bias are read when the forward runs,
// after the pre-hooks (which may swap them: quantization, tensor parallelism).
template <class M, class... Args>
auto forward_of(M& module, Args&&... args) {
  if constexpr (std::is_same_v<std::remove_cv_t<M>, torch::nn::LinearImpl>) {
    return at::linear(std::forward<Args>(args)..., module.weight, module.bias);
  } else {
    return module.forward(std::forward<Args>(args)...);
  }
}
}  // namespace detail

// Runs `body` (a member function of `module`) with `module`'s forward hooks around it.
template <class M, class R, class C, class... Params, class... Args>
R hooked(M& module, R (C::*body)(Params...), Args&&... args) {
  return detail::run_with_hooks<R>(
      detail::base_of(module),
      [&](auto&&... a) -> R { return (module.*body)(std::forward<decltype(a)>(a)...); },
      std::forward<Args>(args)...);
}

// Calls `module`'s forward (a ModuleHolder, a shared_ptr or a module) with its hooks.
template <class Holder, class... Args>
auto call(Holder& holder, Args&&... args) {
  auto& module = *holder;
  using R = decltype(detail::forward_of(module, std::forward<Args>(args)...));
  return detail::run_with_hooks<R>(
      detail::base_of(module),
      [&](auto&&... a) -> R { return detail::forward_of(module, std::forward<decltype(a)>(a)...); },
      std::forward<Args>(args)...);
}

}  // namespace mdist::nn
