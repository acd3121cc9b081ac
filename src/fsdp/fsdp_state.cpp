// The registry of units, the per-root context, and the hooks and autograd nodes that run a
// unit through forward and backward: gather before forward, free after it, gather again when
// its backward begins, reduce its gradients once every call's backward is done, and finish
// whatever is left at the end of the backward.
#include "src/fsdp/fsdp_state.h"

#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "mdist/nn/checkpoint.h"
#include "src/nn/module_registry.h"

namespace mdist::detail {
namespace {

struct ShardEntry {
  std::weak_ptr<FsdpParamGroup> unit;
  std::size_t index = 0;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const c10::TensorImpl*, ShardEntry> shards;
  // A dead module's unit is dropped at the next lookup or sweep; its shards were freed with
  // the module already (the unit holds them weakly).
  nn::detail::ModuleRegistry<std::shared_ptr<FsdpParamGroup>> units{
      [this](std::shared_ptr<FsdpParamGroup>& dropped) { forget_shards(*dropped); }};

  void forget_shards(const FsdpParamGroup& unit) {
    for (const auto& p : unit.params) {
      const auto it = shards.find(p.shard_key());
      if (it != shards.end() && it->second.unit.lock().get() == &unit) shards.erase(it);
    }
  }
};

Registry& registry() {
  static Registry instance;
  return instance;
}

// The context whose pass is running on this thread: a unit without a context that runs
// inside it (wrapped after the root's first forward) joins it.
thread_local std::weak_ptr<FsdpContext> active_context;

std::shared_ptr<FsdpContext> context_for(FsdpParamGroup& unit) {
  if (unit.context) return unit.context;
  if (auto active = active_context.lock()) {
    unit.context = active;
    active->units.push_back(unit.weak_from_this());
    return active;
  }
  // This unit is a root: it claims every unit in its subtree, in module order.
  auto context = std::make_shared<FsdpContext>();
  std::unordered_set<const torch::nn::Module*> seen;
  const auto claim = [&](const torch::nn::Module& module) {
    if (!seen.insert(&module).second) return;
    if (auto member = unit_of(module)) {
      member->context = context;
      context->units.push_back(member);
    }
  };
  claim(*unit.module);
  for (const auto& child : unit.module->modules(/*include_self=*/false)) claim(*child);
  return context;
}

std::vector<std::shared_ptr<FsdpParamGroup>> live_units(const FsdpContext& context) {
  std::vector<std::shared_ptr<FsdpParamGroup>> units;
  for (const auto& weak : context.units) {
    if (auto unit = weak.lock()) units.push_back(std::move(unit));
  }
  return units;
}

// A backward that failed (an exception in a node or a hook) never ran its end-of-backward
// callback: gradients it left on full parameters, prefetches and gathered parameters are
// dropped, so the next step starts clean. The failed step's gradients are lost, whichever
// units had already reduced theirs; the user's zero_grad clears those.
void recover_from_failed_backward(FsdpContext& context) {
  context.final_callback_queued = false;
  context.reducing.reset();
  for (const auto& unit : live_units(context)) {
    unit->discard_reduce();
    unit->discard_gather();
    unit->discard_full_gradients();
    unit->reshard();
    unit->pending_backwards = 0;
    unit->expects_pre_backward = false;
    unit->state = TrainingState::kIdle;
  }
}

void check_backward_state(FsdpContext& context) {
  // current_backward_id(): a checkpoint's recompute runs a nested backward inside the one
  // that queued the callback, which is no failed backward.
  if (context.final_callback_queued && context.callback_graph_task != nn::current_backward_id()) {
    recover_from_failed_backward(context);
  }
}

bool same_order(const std::vector<std::weak_ptr<FsdpParamGroup>>& recorded,
                const std::vector<FsdpParamGroup*>& pass) {
  if (recorded.size() != pass.size()) return false;
  for (std::size_t i = 0; i < pass.size(); ++i) {
    if (recorded[i].lock().get() != pass[i]) return false;
  }
  return true;
}

std::vector<std::weak_ptr<FsdpParamGroup>> weak_order(const std::vector<FsdpParamGroup*>& pass) {
  std::vector<std::weak_ptr<FsdpParamGroup>> order;
  for (FsdpParamGroup* unit : pass) order.push_back(unit->weak_from_this());
  return order;
}

void begin_pass(FsdpContext& context) {
  check_backward_state(context);
  context.pass_pre_order.clear();
  context.pass_post_order.clear();
  context.pass_follows_order = true;
}

void end_pass(FsdpContext& context, bool failed) {
  if (!failed) {
    // Orders change when a step takes another path (a branch skipped); every rank takes the
    // same one, so every rank re-records alike.
    if (!same_order(context.pre_forward_order, context.pass_pre_order)) {
      context.pre_forward_order = weak_order(context.pass_pre_order);
    }
    if (!same_order(context.post_forward_order, context.pass_post_order)) {
      context.post_forward_order = weak_order(context.pass_post_order);
    }
  }
  const auto units = live_units(context);
  // A forward prefetch for a unit this pass did not run.
  for (const auto& unit : units) unit->discard_gather();
  if (failed && !context.final_callback_queued) {
    // The failed forward's graph is gone: nothing is pending from it. A backward of an
    // earlier forward still works (its units are then finished by the end-of-backward
    // callback, which also looks at their state).
    for (const auto& unit : units) {
      unit->reshard();
      unit->pending_backwards = 0;
      unit->expects_pre_backward = false;
      unit->state = TrainingState::kIdle;
    }
  }
}

// Leaves a pass (a unit's forward returned or threw) on `context`.
void leave(FsdpContext& context, bool failed) {
  if (context.depth > 0 && --context.depth == 0) {
    active_context.reset();
    end_pass(context, failed);
  }
}

// An identity autograd node on a unit's tensors whose backward first runs `callback`: on the
// unit's outputs it runs before the unit's own backward (gather the full parameters again);
// on its inputs once the unit's parameter gradients are accumulated (the moment to reduce).
struct UnitBackwardHook : torch::autograd::Node {
  explicit UnitBackwardHook(std::function<void()> callback) : callback_(std::move(callback)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    callback_();
    return std::move(grads);
  }
  std::string name() const override { return "mdist::FsdpUnitBackwardHook"; }

 private:
  std::function<void()> callback_;
};

// Replaces the tensors in `refs` that require grad by aliases whose gradient passes through
// one UnitBackwardHook running `callback`. Returns whether there was any.
bool attach(std::function<void()> callback, nn::TensorRefs& refs) {
  torch::autograd::variable_list tensors;
  std::vector<at::Tensor*> targets;
  for (at::Tensor* ref : refs) {
    if (ref->defined() && ref->requires_grad()) {
      tensors.push_back(*ref);
      targets.push_back(ref);
    }
  }
  if (tensors.empty()) return false;
  auto node = c10::make_intrusive<UnitBackwardHook>(std::move(callback));
  node->set_next_edges(torch::autograd::collect_next_edges(tensors));
  for (std::size_t i = 0; i < targets.size(); ++i) {
    // tensor_data(): a new tensor on the same storage that shares the version counter and
    // is no view, so in-place ops on it (h += residual) are allowed exactly where they
    // would be on the original, and autograd still sees them.
    at::Tensor alias = tensors[i].tensor_data();
    torch::autograd::impl::set_gradient_edge(
        alias, torch::autograd::Edge(node, node->add_input_metadata(alias)));
    *targets[i] = std::move(alias);
  }
  return true;
}

void cast_floating(nn::TensorRefs& refs, c10::ScalarType dtype) {
  for (at::Tensor* ref : refs) {
    if (ref->defined() && at::isFloatingType(ref->scalar_type()) && ref->scalar_type() != dtype) {
      *ref = ref->to(dtype);
    }
  }
}

void to_device(nn::TensorRefs& refs, const c10::Device& device) {
  for (at::Tensor* ref : refs) {
    if (ref->defined() && ref->device() != device) *ref = ref->to(device);
  }
}

// A unit's post-backward. Its reduce-scatter stays in flight while the next unit's backward
// computes; the one issued before it is finished now (so at most two are in flight) and the
// last one by finish_backward. Without a queued end-of-backward callback nothing would finish
// it later, so then it is finished at once.
void run_post_backward(const std::shared_ptr<FsdpParamGroup>& unit) {
  unit->post_backward();
  FsdpContext* const context = unit->context.get();
  if (context == nullptr || !context->final_callback_queued) {
    unit->finish_reduce();
    return;
  }
  if (const auto previous = context->reducing.lock(); previous && previous != unit) {
    previous->finish_reduce();
  }
  context->reducing = unit;
}

// At the end of a backward: the post-backward of every unit whose own did not run (its
// inputs needed no gradient, e.g. the root taking token ids, or a call's backward never
// reached its inputs), then whatever a prefetch left in flight.
void finish_backward(const std::weak_ptr<FsdpContext>& weak) {
  const auto context = weak.lock();
  if (!context) return;
  context->final_callback_queued = false;
  const auto units = live_units(*context);
  for (const auto& unit : units) {
    if (unit->pending_backwards > 0 || unit->state == TrainingState::kPreBackward) {
      run_post_backward(unit);
    }
  }
  // Every shard gradient is in place when backward() returns.
  context->reducing.reset();
  for (const auto& unit : units) unit->finish_reduce();
  for (const auto& unit : units) {
    unit->discard_gather();
    unit->expects_pre_backward = false;
    unit->state = TrainingState::kIdle;
  }
}

// The unit's backward begins (its outputs' gradients are here).
void pre_backward(const std::weak_ptr<FsdpParamGroup>& weak) {
  const auto unit = weak.lock();
  if (!unit || !unit->context) return;
  FsdpContext& context = *unit->context;
  check_backward_state(context);
  if (!context.final_callback_queued) {
    context.final_callback_queued = true;
    context.callback_graph_task = nn::current_backward_id();
    // On the outermost backward: a unit whose backward begins inside a checkpoint's nested
    // backward must not finish every unit when that nested backward ends.
    nn::queue_end_of_backward([weak_context = std::weak_ptr<FsdpContext>(unit->context)] {
      finish_backward(weak_context);
    });
  }
  unit->unshard();
  unit->state = TrainingState::kPreBackward;
  // Backward runs the units in reverse order of their forwards' ends: gather the one that
  // ended just before this one while this one computes.
  const auto& order = context.post_forward_order;
  for (std::size_t i = 1; i < order.size(); ++i) {
    if (order[i].lock() != unit) continue;
    if (const auto previous = order[i - 1].lock();
        previous && previous != unit && previous->expects_pre_backward &&
        previous->state != TrainingState::kPostBackward) {
      previous->start_unshard();
    }
    break;
  }
}

// A call's gradients with respect to its inputs are computed, so its parameters' are too.
void post_backward_of_call(const std::weak_ptr<FsdpParamGroup>& weak) {
  const auto unit = weak.lock();
  if (!unit) return;
  if (unit->pending_backwards > 0 && --unit->pending_backwards == 0) run_post_backward(unit);
}

// The forward of a checkpointed unit running again in backward (mdist/nn/checkpoint.h): its
// first forward ran under no-grad, so it registered no backward hooks and left no backward
// pending. This one gathers the parameters and registers them, as a forward with grad
// would, but is no forward pass: the recorded orders and prefetches stay the step's, and the
// parameters stay gathered for the unit's backward, which follows at once (its pre-backward
// then gathers nothing, and post-backward reduces and reshards once, as without checkpoint).
void pre_recompute(FsdpParamGroup& unit, nn::TensorRefs& inputs) {
  unit.state = TrainingState::kForward;
  const c10::OptionalDeviceGuard guard(unit.compute_device);
  to_device(inputs, unit.compute_device);
  unit.unshard();
  const auto& mp = unit.options.mp_policy;
  if (mp.param_dtype && mp.cast_forward_inputs) cast_floating(inputs, *mp.param_dtype);
  ++unit.pending_backwards;
  attach([weak = unit.weak_from_this()] { post_backward_of_call(weak); }, inputs);
}

void post_recompute(FsdpParamGroup& unit, nn::TensorRefs& outputs) {
  const auto& mp = unit.options.mp_policy;
  if (mp.output_dtype) cast_floating(outputs, *mp.output_dtype);
  if (attach([weak = unit.weak_from_this()] { pre_backward(weak); }, outputs)) {
    unit.expects_pre_backward = true;
  }
  unit.state = TrainingState::kIdle;
}

void pre_forward(FsdpParamGroup& unit, nn::TensorRefs& inputs) {
  if (nn::recomputing() && at::GradMode::is_enabled() && unit.context) {
    pre_recompute(unit, inputs);
    return;
  }
  const auto context = context_for(unit);
  if (context->depth++ == 0) {
    active_context = context;
    begin_pass(*context);
  }
  try {
    // Forward prefetch: where this pass follows the recorded order, the unit after this one
    // is gathered while this one computes.
    std::shared_ptr<FsdpParamGroup> next;
    if (std::find(context->pass_pre_order.begin(), context->pass_pre_order.end(), &unit) ==
        context->pass_pre_order.end()) {
      const std::size_t position = context->pass_pre_order.size();
      context->pass_pre_order.push_back(&unit);
      const auto& order = context->pre_forward_order;
      context->pass_follows_order = context->pass_follows_order && position < order.size() &&
                                    order[position].lock().get() == &unit;
      if (context->pass_follows_order && position + 1 < order.size()) {
        next = order[position + 1].lock();
      }
    }
    unit.state = TrainingState::kForward;
    const c10::OptionalDeviceGuard guard(unit.compute_device);
    to_device(inputs, unit.compute_device);
    unit.unshard();
    if (next && next.get() != &unit) next->start_unshard();
    const auto& mp = unit.options.mp_policy;
    if (mp.param_dtype && mp.cast_forward_inputs) cast_floating(inputs, *mp.param_dtype);
    if (at::GradMode::is_enabled()) {
      ++unit.pending_backwards;
      attach([weak = unit.weak_from_this()] { post_backward_of_call(weak); }, inputs);
    }
  } catch (...) {
    unit.state = TrainingState::kIdle;
    leave(*context, /*failed=*/true);
    throw;
  }
}

// A throw in here reaches on_forward_error, which leaves the pass.
void post_forward(FsdpParamGroup& unit, nn::TensorRefs& outputs) {
  if (nn::recomputing() && at::GradMode::is_enabled() && unit.context) {  // as pre_forward
    post_recompute(unit, outputs);
    return;
  }
  const auto context = unit.context;
  const auto& mp = unit.options.mp_policy;
  if (mp.output_dtype) cast_floating(outputs, *mp.output_dtype);
  const bool training = at::GradMode::is_enabled();
  if (training && attach([weak = unit.weak_from_this()] { pre_backward(weak); }, outputs)) {
    unit.expects_pre_backward = true;
  }
  if (context && std::find(context->pass_post_order.begin(), context->pass_post_order.end(),
                           &unit) == context->pass_post_order.end()) {
    context->pass_post_order.push_back(&unit);
  }
  // Forward-only use leaves nothing gathered behind, unless a backward is still to come.
  if (unit.options.reshard_after_forward || (!training && unit.pending_backwards == 0)) {
    unit.reshard();
  }
  unit.state = TrainingState::kIdle;
  if (context) leave(*context, /*failed=*/false);
}

// The forward threw between the hooks: undo what the pre-forward hook did.
void on_forward_error(FsdpParamGroup& unit) noexcept {
  unit.state = TrainingState::kIdle;
  try {
    unit.reshard();
  } catch (...) {  // freeing storage does not throw; nothing to add to the original error
  }
  if (unit.context) {
    try {
      leave(*unit.context, /*failed=*/true);
    } catch (...) {  // a stray gather that failed: the original error is the one to report
    }
  }
}

}  // namespace

void register_unit(const std::shared_ptr<FsdpParamGroup>& unit) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  r.units.find_or_add(*unit->module) = unit;
  for (std::size_t i = 0; i < unit->params.size(); ++i) {
    r.shards[unit->params[i].shard_key()] = {unit, i};
  }
}

std::shared_ptr<FsdpParamGroup> unit_of(const torch::nn::Module& module) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  const auto* const unit = r.units.find(module);
  return unit ? *unit : nullptr;
}

void sweep_units() {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  r.units.sweep();
}

std::optional<ManagedRef> find_managed(const at::Tensor& registered) {
  if (!registered.defined()) return std::nullopt;
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  const auto it = r.shards.find(registered.unsafeGetTensorImpl());
  if (it == r.shards.end()) return std::nullopt;
  auto unit = it->second.unit.lock();
  // The entry may be a dead shard's, whose address a new tensor now has.
  if (!unit || !unit->params[it->second.index].shard().is_same(registered)) return std::nullopt;
  return ManagedRef{std::move(unit), it->second.index};
}

void install_hooks(const std::shared_ptr<FsdpParamGroup>& unit) {
  const std::weak_ptr<FsdpParamGroup> weak = unit;
  unit->hooks.push_back(
      nn::register_forward_pre_hook(*unit->module, [weak](torch::nn::Module&, nn::TensorRefs& in) {
        if (const auto u = weak.lock()) pre_forward(*u, in);
      }));
  unit->hooks.push_back(
      nn::register_forward_hook(*unit->module, [weak](torch::nn::Module&, nn::TensorRefs& out) {
        if (const auto u = weak.lock()) post_forward(*u, out);
      }));
  unit->hooks.push_back(nn::register_forward_error_hook(*unit->module, [weak](torch::nn::Module&) {
    if (const auto u = weak.lock()) on_forward_error(*u);
  }));
}

}  // namespace mdist::detail
