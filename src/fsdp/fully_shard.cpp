// fully_shard: finding the parameters a unit manages, turning them into shards, and the
// handle. The hooks that run the unit live in fsdp_state.cpp.
#include "mdist/fsdp/fully_shard.h"

#include <ATen/ATen.h>

#include <cmath>
#include <unordered_map>
#include <unordered_set>

#include "mdist/error.h"
#include "mdist/nn/meta.h"
#include "mdist/runtime/device.h"
#include "mdist/runtime/runtime.h"
#include "src/fsdp/fsdp_state.h"

namespace mdist {
namespace detail {
namespace {

// torch::nn::Module keeps its parameter table protected; a derived class may name it
// through a member pointer, which lets a unit put the shard where parameters() looks.
struct ParameterTable : torch::nn::Module {
  static torch::OrderedDict<std::string, at::Tensor>& of(torch::nn::Module& module) {
    return module.*(&ParameterTable::parameters_);
  }
};

// One place in the module tree where a parameter is registered.
struct Slot {
  torch::nn::Module* owner;
  std::string key;
};

// A parameter found under the module being wrapped, with every slot it is registered in
// (a tied weight has several) and its names relative to that module.
struct Found {
  at::Tensor tensor;
  std::vector<Slot> slots;
  std::vector<std::string> names;
};

// Every parameter under `module`, once each, skipping subtrees that are units of their own.
void find_params(torch::nn::Module& module, const std::string& prefix, bool is_root,
                 std::vector<Found>& found,
                 std::unordered_map<const c10::TensorImpl*, std::size_t>& index,
                 std::unordered_set<const torch::nn::Module*>& visited) {
  if (!visited.insert(&module).second) return;  // a submodule registered twice
  if (!is_root && unit_of(module)) return;
  for (auto& item : ParameterTable::of(module)) {
    const at::Tensor& tensor = item.value();
    if (!tensor.defined()) continue;
    const auto [it, added] = index.emplace(tensor.unsafeGetTensorImpl(), found.size());
    if (added) found.push_back({tensor, {}, {}});
    Found& entry = found[it->second];
    entry.slots.push_back({&module, item.key()});
    entry.names.push_back(prefix + item.key());
  }
  for (const auto& child : module.named_children()) {
    find_params(*child.value(), prefix + child.key() + ".", false, found, index, visited);
  }
}

bool is_ignored(const at::Tensor& tensor, const FullyShardOptions& options) {
  for (const auto& ignored : options.ignored_params) {
    if (ignored.unsafeGetTensorImpl() == tensor.unsafeGetTensorImpl()) return true;
  }
  return false;
}

c10::Device default_compute_device(const FullyShardOptions& options, const at::Tensor& first) {
  if (options.device) return *options.device;
  // Parameters built on the meta device, or kept on the CPU by offloading, say nothing about
  // where to compute: the rank's own device does.
  if (!first.defined() || options.offload_policy || first.is_meta()) return compute_device();
  return first.device();
}

// Makes `found` a shard of `unit`: the shard replaces it in every slot, the module's own
// tensor becomes the storage-less full parameter in the compute dtype.
FsdpParam make_param(FsdpParamGroup& unit, const Found& found, int64_t offset, bool pin) {
  const at::Tensor& registered = found.tensor;
  const std::vector<int64_t> full_shape = registered.sizes().vec();
  const int64_t rows = registered.dim() > 0 ? registered.size(0) : 1;
  const int64_t row_numel = rows > 0 ? registered.numel() / rows : 0;
  const int64_t chunk_rows = (rows + unit.world - 1) / unit.world;
  std::vector<int64_t> shard_shape = full_shape;
  if (shard_shape.empty()) shard_shape.push_back(1);
  shard_shape[0] = chunk_rows;
  // Only shard-sized memory is ever allocated here: a parameter on the meta device has no
  // values to copy (a checkpoint fills the shard later), and the full parameter below gets
  // no storage until the first unshard.
  at::Tensor shard =
      at::zeros(shard_shape, registered.options().device(unit.shard_device).pinned_memory(pin));
  const int64_t first_row = unit.rank * chunk_rows;
  const int64_t own_rows = std::clamp<int64_t>(rows - first_row, 0, chunk_rows);
  if (own_rows > 0 && !registered.is_meta()) {
    shard.view({chunk_rows, row_numel})
        .narrow(0, 0, own_rows)
        .copy_(registered.reshape({rows, row_numel})
                   .narrow(0, first_row, own_rows)
                   .to(unit.shard_device));
  }
  shard.set_requires_grad(registered.requires_grad());

  at::Tensor full = registered;  // the TensorImpl the module's members hold
  const at::Tensor storageless = nn::storageless(
      full_shape, registered.options().dtype(unit.compute_dtype).device(unit.compute_device));
  if (registered.is_meta()) {
    nn::assign_in_place(full, storageless);  // set_data cannot leave the meta device
  } else {
    full.set_data(storageless);
  }
  free_storage(full);
  for (const Slot& slot : found.slots) ParameterTable::of(*slot.owner)[slot.key] = shard;
  return FsdpParam(found.names, shard, full, full_shape, unit.world, offset);
}

}  // namespace
}  // namespace detail

FsdpHandle fully_shard(torch::nn::Module& module, const FullyShardOptions& options) {
  using detail::Found;
  detail::sweep_units();
  const std::string label = module.name();
  if (detail::unit_of(module)) {
    throw Error("mdist: fully_shard: " + label + " is already wrapped; wrap each module once");
  }
  std::vector<Found> found;
  {
    std::unordered_map<const c10::TensorImpl*, std::size_t> index;
    std::unordered_set<const torch::nn::Module*> visited;
    detail::find_params(module, "", true, found, index, visited);
  }
  std::vector<const Found*> sharded;
  std::vector<const Found*> replicated;
  for (const Found& f : found) {
    // A parameter that is already a unit's shard: its module was wrapped as part of a parent.
    if (const auto managed = detail::find_managed(f.tensor)) {
      throw Error("mdist: fully_shard: parameter '" + f.names.front() + "' of " + label +
                  " is already managed by the unit of " + managed->unit->label +
                  "; wrap inner modules before their parents");
    }
    (detail::is_ignored(f.tensor, options) ? replicated : sharded).push_back(&f);
  }
  if (sharded.empty() && replicated.empty()) {
    throw Error("mdist: fully_shard: " + label +
                " has no parameters to manage (none of its own, and every submodule's are "
                "managed by a nested unit)");
  }

  if (options.gradient_divide_factor &&
      !(std::isfinite(*options.gradient_divide_factor) && *options.gradient_divide_factor > 0)) {
    throw Error("mdist: fully_shard: " + label +
                ": gradient_divide_factor must be positive and "
                "finite, got " +
                std::to_string(*options.gradient_divide_factor));
  }
  if (!options.group.is_not_used() && !options.group.is_member()) {
    // size() and rank() are -1 there (torch's convention); there is nothing to shard over.
    throw Error("mdist: fully_shard: " + label + ": this rank is not a member of " +
                options.group.name());
  }
  auto unit = std::make_shared<detail::FsdpParamGroup>();
  unit->module = &module;
  unit->label = label;
  unit->options = options;
  unit->world = size(options.group);
  unit->rank = rank(options.group);

  // One dtype per unit: the flat buffers hold every sharded parameter.
  const at::Tensor first = sharded.empty() ? at::Tensor() : sharded.front()->tensor;
  if (first.defined()) unit->shard_dtype = first.scalar_type();
  for (const Found* f : sharded) {
    if (f->tensor.scalar_type() != unit->shard_dtype) {
      throw Error("mdist: fully_shard: parameters of one unit must share a dtype, but '" +
                  sharded.front()->names.front() + "' is " + c10::toString(unit->shard_dtype) +
                  " and '" + f->names.front() + "' is " + c10::toString(f->tensor.scalar_type()) +
                  "; ignore one of them or wrap them in separate units");
    }
    if (f->tensor.dim() > 0 && f->tensor.size(0) == 0) {
      throw Error("mdist: fully_shard: parameter '" + f->names.front() +
                  "' has 0 rows along dim 0 and cannot be sharded");
    }
  }
  const auto& mp = options.mp_policy;
  unit->compute_dtype = mp.param_dtype.value_or(unit->shard_dtype);
  unit->reduce_dtype = mp.reduce_dtype.value_or(unit->compute_dtype);
  unit->compute_device = detail::default_compute_device(
      options,
      first.defined() ? first : (replicated.empty() ? at::Tensor() : replicated.front()->tensor));
  unit->shard_device = options.offload_policy ? c10::Device(c10::kCPU) : unit->compute_device;
  const bool pin = options.offload_policy && options.offload_policy->pin_memory &&
                   unit->compute_device.is_cuda();

  {
    const at::NoGradGuard no_grad;
    int64_t offset = 0;
    for (const Found* f : sharded) {
      unit->params.push_back(detail::make_param(*unit, *f, offset, pin));
      offset += unit->params.back().shard_numel();
    }
    unit->flat_numel = offset;
  }
  for (const Found* f : replicated) {
    unit->replicated.push_back({f->names.front(), detail::WeakTensor(f->tensor)});
  }
  detail::register_unit(unit);
  detail::install_hooks(unit);
  return FsdpHandle(unit);
}

std::optional<FsdpHandle> fsdp_handle(const torch::nn::Module& module) {
  auto unit = detail::unit_of(module);
  if (!unit) return std::nullopt;
  return FsdpHandle(std::move(unit));
}

bool is_fsdp2_model(const torch::nn::Module& module) {
  if (fsdp_handle(module)) return true;
  for (const auto& child : module.modules(/*include_self=*/false)) {
    if (fsdp_handle(*child)) return true;
  }
  return false;
}

namespace {
detail::FsdpParamGroup& live(const std::shared_ptr<detail::FsdpParamGroup>& unit) {
  if (!unit->alive()) {
    throw Error("mdist: FsdpHandle: the module " + unit->label + " it wraps no longer exists");
  }
  return *unit;
}
}  // namespace

void FsdpHandle::unshard() { live(unit_).unshard(); }
void FsdpHandle::reshard() {
  unit_->discard_gather();
  unit_->reshard();
}
bool FsdpHandle::is_unsharded() const { return unit_->unsharded && unit_->alive(); }
bool FsdpHandle::is_gathering() const { return unit_->gather.started(); }
FsdpCommStats FsdpHandle::communication() const { return unit_->comm; }
void FsdpHandle::reset_communication() { unit_->comm = FsdpCommStats(); }
void FsdpHandle::set_requires_gradient_sync(bool sync) { unit_->requires_gradient_sync = sync; }
void FsdpHandle::set_reshard_after_backward(bool reshard) {
  unit_->reshard_after_backward = reshard;
}

std::vector<std::string> FsdpHandle::managed_parameter_names() const {
  std::vector<std::string> names;
  for (const auto& p : unit_->params) names.push_back(p.name());
  return names;
}

std::vector<std::string> FsdpHandle::replicated_parameter_names() const {
  std::vector<std::string> names;
  for (const auto& p : unit_->replicated) names.push_back(p.name);
  return names;
}

namespace {
const detail::FsdpParam& find_param(const detail::FsdpParamGroup& unit, const std::string& name) {
  for (const auto& p : unit.params) {
    for (const auto& alias : p.names()) {
      if (alias == name) return p;
    }
  }
  throw Error("mdist: FsdpHandle: no managed parameter named '" + name + "'");
}
}  // namespace

std::vector<int64_t> FsdpHandle::full_shape(const std::string& name) const {
  return find_param(*unit_, name).full_shape();
}

std::vector<int64_t> FsdpHandle::shard_shape(const std::string& name) const {
  const auto& p = find_param(*unit_, name);
  std::vector<int64_t> shape = p.full_shape();
  if (shape.empty()) shape.push_back(1);
  shape[0] = p.chunk_rows();
  return shape;
}

}  // namespace mdist
