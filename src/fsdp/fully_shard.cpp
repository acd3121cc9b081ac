// fully_shard: turning a module's parameters into shards, and the hooks and autograd nodes
// that gather them for forward and backward and reduce their gradients.
#include "mdist/fsdp/fully_shard.h"

#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>

#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "mdist/error.h"
#include "mdist/nn/meta.h"
#include "mdist/runtime/runtime.h"
#include "src/fsdp/fsdp_unit.h"

namespace mdist {
namespace detail {

void free_storage(const at::Tensor& tensor);

namespace {

// torch::nn::Module keeps its parameter table protected; a derived class may name it
// through a member pointer, which lets a unit put the shard where parameters() looks.
struct ParameterTable : torch::nn::Module {
  static torch::OrderedDict<std::string, at::Tensor>& of(torch::nn::Module& module) {
    return module.*(&ParameterTable::parameters_);
  }
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, std::shared_ptr<FsdpUnit>> by_module;
  std::map<int64_t, std::weak_ptr<FsdpUnit>> by_id;
  int64_t next_id = 1;
  bool final_callback_queued = false;
  // Prefetch order: the unit whose forward began last in the current pass, and how many
  // unit forwards are running (0: the next one starts a new pass).
  std::weak_ptr<FsdpUnit> last_forward;
  int active_forwards = 0;
};

Registry& registry() {
  static Registry instance;
  return instance;
}

// The unit wrapping `module`, if that module is still alive (a dead module's address can be
// reused by a new one, which is then not wrapped). Caller holds the registry lock.
std::shared_ptr<FsdpUnit> live_unit(Registry& r, const torch::nn::Module* module) {
  const auto it = r.by_module.find(module);
  if (it == r.by_module.end()) return nullptr;
  if (it->second->owner_tracked && it->second->owner.expired()) {
    r.by_id.erase(it->second->id);
    r.by_module.erase(it);
    return nullptr;
  }
  return it->second;
}

// Drops the units of modules that no longer exist, freeing their shards.
void sweep_dead_units(Registry& r) {
  std::erase_if(r.by_module, [&](const auto& entry) {
    const bool dead = entry.second->owner_tracked && entry.second->owner.expired();
    if (dead) r.by_id.erase(entry.second->id);
    return dead;
  });
}

// At the end of a backward pass: finish every unit whose post-backward did not run (its
// inputs needed no gradient, e.g. the root taking token ids).
void finish_backward() {
  std::vector<std::shared_ptr<FsdpUnit>> units;
  {
    auto& r = registry();
    const std::lock_guard lock(r.mutex);
    r.final_callback_queued = false;
    for (const auto& [id, weak] : r.by_id) {
      if (auto unit = weak.lock()) units.push_back(std::move(unit));
    }
  }
  for (const auto& unit : units) {
    unit->post_backward();
    // A prefetch for a unit whose backward never came: finish it and free the memory.
    if (unit->gather_started) {
      unit->unshard();
      unit->reshard();
    }
  }
}

void queue_final_callback() {
  {
    auto& r = registry();
    const std::lock_guard lock(r.mutex);
    if (r.final_callback_queued) return;
    r.final_callback_queued = true;
  }
  torch::autograd::Engine::get_default_engine().queue_callback(finish_backward);
}

// An identity autograd node on a unit's tensors whose backward first runs `callback`:
// on the unit's outputs it runs before the unit's own backward (gather the full parameters
// again); on its inputs it runs once the unit's parameter gradients are accumulated (the
// moment to reduce-scatter them).
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
// one UnitBackwardHook running `callback`.
void attach(std::function<void()> callback, nn::TensorRefs& refs) {
  torch::autograd::variable_list tensors;
  std::vector<at::Tensor*> targets;
  for (at::Tensor* ref : refs) {
    if (ref->defined() && ref->requires_grad()) {
      tensors.push_back(*ref);
      targets.push_back(ref);
    }
  }
  if (tensors.empty()) return;
  auto node = c10::make_intrusive<UnitBackwardHook>(std::move(callback));
  node->set_next_edges(torch::autograd::collect_next_edges(tensors));
  const at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    at::Tensor alias = tensors[i].view_as(tensors[i]);
    torch::autograd::impl::set_gradient_edge(
        alias, torch::autograd::Edge(node, node->add_input_metadata(alias)));
    *targets[i] = alias;
  }
}

void cast_floating(nn::TensorRefs& refs, c10::ScalarType dtype) {
  for (at::Tensor* ref : refs) {
    if (ref->defined() && at::isFloatingType(ref->scalar_type()) && ref->scalar_type() != dtype) {
      *ref = ref->to(dtype);
    }
  }
}

// Links units in the order their forwards begin, once: the first pass fixes the prefetch
// order, the same on every rank, as collectives must be issued in one order.
void record_forward_order(FsdpUnit& unit) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  if (r.active_forwards++ == 0) r.last_forward.reset();
  if (const auto last = r.last_forward.lock(); last && last.get() != &unit) {
    if (last->next_in_forward.expired()) last->next_in_forward = unit.weak_from_this();
    if (unit.previous_in_forward.expired()) unit.previous_in_forward = last;
  }
  r.last_forward = unit.weak_from_this();
}

void end_forward() {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  if (r.active_forwards > 0) --r.active_forwards;
}

void to_device(nn::TensorRefs& refs, const c10::Device& device) {
  for (at::Tensor* ref : refs) {
    if (ref->defined() && ref->device() != device) *ref = ref->to(device);
  }
}

void pre_forward(FsdpUnit& unit, nn::TensorRefs& inputs) {
  record_forward_order(unit);
  to_device(inputs, unit.compute_device);
  unit.unshard();
  // Prefetch: the next unit's all-gather runs while this one computes.
  if (const auto next = unit.next_in_forward.lock()) next->start_unshard();
  const auto& mp = unit.options.mp_policy;
  if (mp.param_dtype && mp.cast_forward_inputs) cast_floating(inputs, *mp.param_dtype);
  if (at::GradMode::is_enabled()) {
    unit.backward_pending = true;
    attach(
        [weak = unit.weak_from_this()] {
          if (const auto u = weak.lock()) u->post_backward();
        },
        inputs);
  }
}

void post_forward(FsdpUnit& unit, nn::TensorRefs& outputs) {
  const auto& mp = unit.options.mp_policy;
  if (mp.output_dtype) cast_floating(outputs, *mp.output_dtype);
  const bool training = at::GradMode::is_enabled();
  if (training) {
    attach(
        [weak = unit.weak_from_this()] {
          queue_final_callback();
          const auto u = weak.lock();
          if (!u) return;
          u->unshard();
          // Backward runs the units in reverse: gather the one before this while it computes.
          if (const auto previous = u->previous_in_forward.lock();
              previous && !previous->unsharded) {
            previous->start_unshard();
          }
        },
        outputs);
  }
  // Forward-only use leaves nothing gathered behind.
  if (!training || unit.options.reshard_after_forward) unit.reshard();
  if (!training) unit.backward_pending = false;
  end_forward();
}

bool same_tensor(const at::Tensor& a, const at::Tensor& b) {
  return a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl();
}

// Every (owner, key, full name) of a parameter under `root`, skipping subtrees that are
// already units of their own.
struct Found {
  torch::nn::Module* owner;
  std::string key;
  std::string name;
};
void find_params(torch::nn::Module& module, const std::string& prefix, bool is_root,
                 std::vector<Found>& found) {
  if (!is_root) {
    auto& r = registry();
    const std::lock_guard lock(r.mutex);
    if (live_unit(r, &module)) return;
  }
  for (auto& item : ParameterTable::of(module)) {
    if (item.value().defined()) found.push_back({&module, item.key(), prefix + item.key()});
  }
  for (const auto& child : module.named_children()) {
    find_params(*child.value(), prefix + child.key() + ".", false, found);
  }
}

std::string module_label(const torch::nn::Module& module) { return module.name(); }

}  // namespace

std::optional<ManagedRef> find_managed(const at::Tensor& registered) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  for (const auto& [id, weak] : r.by_id) {
    auto unit = weak.lock();
    if (!unit || (unit->owner_tracked && unit->owner.expired())) continue;
    for (std::size_t i = 0; i < unit->params.size(); ++i) {
      if (same_tensor(unit->params[i].shard, registered)) return ManagedRef{unit, i};
    }
  }
  return std::nullopt;
}

}  // namespace detail

FsdpHandle fully_shard(torch::nn::Module& module, const FullyShardOptions& options) {
  using detail::ManagedParam;
  auto& r = detail::registry();
  {
    const std::lock_guard lock(r.mutex);
    detail::sweep_dead_units(r);
    if (detail::live_unit(r, &module)) {
      throw Error("mdist: fully_shard: " + detail::module_label(module) +
                  " is already wrapped; wrap each module once");
    }
  }
  std::vector<detail::Found> found;
  detail::find_params(module, "", true, found);
  std::erase_if(found, [&](const detail::Found& f) {
    const at::Tensor& tensor = detail::ParameterTable::of(*f.owner)[f.key];
    for (const auto& ignored : options.ignored_params) {
      if (detail::same_tensor(ignored, tensor)) return true;
    }
    return false;
  });
  if (found.empty()) {
    throw Error("mdist: fully_shard: " + detail::module_label(module) +
                " has no parameters to manage (none of its own, and every submodule's are "
                "ignored or managed by a nested unit)");
  }

  auto unit = std::make_shared<detail::FsdpUnit>();
  unit->module = &module;
  try {
    unit->owner = module.shared_from_this();
    unit->owner_tracked = true;
  } catch (const std::bad_weak_ptr&) {
    // A module not owned by a shared_ptr: its unit lives as long as the process.
  }
  unit->options = options;
  unit->world = size(options.group);
  unit->rank = rank(options.group);

  // One dtype per unit: the flat buffers hold every parameter.
  const at::Tensor& first = detail::ParameterTable::of(*found.front().owner)[found.front().key];
  unit->shard_dtype = first.scalar_type();
  for (const auto& f : found) {
    const at::Tensor& tensor = detail::ParameterTable::of(*f.owner)[f.key];
    if (tensor.scalar_type() != unit->shard_dtype) {
      throw Error("mdist: fully_shard: parameters of one unit must share a dtype, but '" +
                  found.front().name + "' is " + c10::toString(unit->shard_dtype) + " and '" +
                  f.name + "' is " + c10::toString(tensor.scalar_type()) +
                  "; ignore one of them or wrap them in separate units");
    }
    if (tensor.dim() > 0 && tensor.size(0) == 0) {
      throw Error("mdist: fully_shard: parameter '" + f.name +
                  "' has 0 rows along dim 0 and cannot be sharded");
    }
  }
  const auto& mp = options.mp_policy;
  unit->compute_dtype = mp.param_dtype.value_or(unit->shard_dtype);
  unit->reduce_dtype = mp.reduce_dtype.value_or(unit->compute_dtype);
  const c10::Device param_device = first.device();
  if (options.device) {
    unit->compute_device = *options.device;
  } else if (options.offload_policy || param_device.is_meta()) {
    // Parameters built on the meta device say nothing about where to compute.
    unit->compute_device = at::hasCUDA() ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
  } else {
    unit->compute_device = param_device;
  }
  unit->shard_device = options.offload_policy ? c10::Device(c10::kCPU) : unit->compute_device;
  const bool pin = options.offload_policy && options.offload_policy->pin_memory &&
                   unit->compute_device.is_cuda();

  const at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (const auto& f : found) {
    at::Tensor& registered = detail::ParameterTable::of(*f.owner)[f.key];
    ManagedParam p;
    p.name = f.name;
    p.owner = f.owner;
    p.key = f.key;
    p.full_shape = registered.sizes().vec();
    p.rows = registered.dim() > 0 ? registered.size(0) : 1;
    p.row_numel = p.rows > 0 ? registered.numel() / p.rows : 0;
    p.chunk_rows = (p.rows + unit->world - 1) / unit->world;
    p.offset = offset;
    offset += p.shard_numel();

    std::vector<int64_t> shard_shape = p.full_shape;
    if (shard_shape.empty()) shard_shape.push_back(1);
    shard_shape[0] = p.chunk_rows;
    // Only shard-sized memory is ever allocated here: a parameter on the meta device has no
    // values to copy (a checkpoint fills the shard later), and the full parameter below gets
    // no storage until the first unshard.
    at::Tensor shard =
        at::zeros(shard_shape, registered.options().device(unit->shard_device).pinned_memory(pin));
    const int64_t first_row = unit->rank * p.chunk_rows;
    const int64_t own_rows = std::max<int64_t>(0, std::min(p.chunk_rows, p.rows - first_row));
    if (own_rows > 0 && !registered.is_meta()) {
      shard.view({p.chunk_rows, p.row_numel})
          .narrow(0, 0, own_rows)
          .copy_(registered.reshape({p.rows, p.row_numel})
                     .narrow(0, first_row, own_rows)
                     .to(unit->shard_device));
    }
    shard.set_requires_grad(registered.requires_grad());

    // The module's own tensor becomes the full parameter in the compute dtype, empty until
    // the next unshard; the parameter table gets the shard.
    p.unsharded = registered;
    const at::Tensor full = nn::storageless(
        p.full_shape, registered.options().dtype(unit->compute_dtype).device(unit->compute_device));
    if (registered.is_meta()) {
      nn::assign_in_place(p.unsharded, full);  // set_data cannot leave the meta device
    } else {
      p.unsharded.set_data(full);
    }
    detail::free_storage(p.unsharded);
    registered = shard;
    p.shard = shard;
    unit->params.push_back(std::move(p));
  }
  unit->flat_numel = offset;

  {
    const std::lock_guard lock(r.mutex);
    unit->id = r.next_id++;
    r.by_module[&module] = unit;
    r.by_id[unit->id] = unit;
  }
  const std::weak_ptr<detail::FsdpUnit> weak = unit;
  unit->pre_hook =
      nn::register_forward_pre_hook(module, [weak](torch::nn::Module&, nn::TensorRefs& in) {
        if (const auto u = weak.lock()) detail::pre_forward(*u, in);
      });
  unit->post_hook =
      nn::register_forward_hook(module, [weak](torch::nn::Module&, nn::TensorRefs& out) {
        if (const auto u = weak.lock()) detail::post_forward(*u, out);
      });
  return FsdpHandle(unit);
}

std::optional<FsdpHandle> fsdp_handle(const torch::nn::Module& module) {
  auto& r = detail::registry();
  const std::lock_guard lock(r.mutex);
  const auto unit = detail::live_unit(r, &module);
  if (!unit) return std::nullopt;
  return FsdpHandle(unit);
}

bool is_fsdp2_model(const torch::nn::Module& module) {
  if (fsdp_handle(module)) return true;
  for (const auto& child : module.modules(/*include_self=*/false)) {
    if (fsdp_handle(*child)) return true;
  }
  return false;
}

void FsdpHandle::unshard() { unit_->unshard(); }
void FsdpHandle::reshard() { unit_->reshard(); }
bool FsdpHandle::is_unsharded() const { return unit_->unsharded; }
bool FsdpHandle::is_gathering() const { return unit_->gather_started; }
void FsdpHandle::set_requires_gradient_sync(bool sync) { unit_->requires_gradient_sync = sync; }
void FsdpHandle::set_reshard_after_backward(bool reshard) {
  unit_->reshard_after_backward = reshard;
}

std::vector<std::string> FsdpHandle::managed_parameter_names() const {
  std::vector<std::string> names;
  for (const auto& p : unit_->params) names.push_back(p.name);
  return names;
}

namespace {
const detail::ManagedParam& find_param(const detail::FsdpUnit& unit, const std::string& name) {
  for (const auto& p : unit.params) {
    if (p.name == name) return p;
  }
  throw Error("mdist: FsdpHandle: no managed parameter named '" + name + "'");
}
}  // namespace

std::vector<int64_t> FsdpHandle::full_shape(const std::string& name) const {
  return find_param(*unit_, name).full_shape;
}

std::vector<int64_t> FsdpHandle::shard_shape(const std::string& name) const {
  return find_param(*unit_, name).shard.sizes().vec();
}

}  // namespace mdist
