// Sharded and full state dicts of wrapped models, and clip_grad_norm_ over sharded gradients.
#include "mdist/fsdp/state_dict.h"

#include <cmath>
#include <limits>
#include <set>
#include <sstream>

#include "mdist/error.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"
#include "src/fsdp/fsdp_unit.h"

namespace mdist {
namespace {

std::string shape_text(c10::IntArrayRef shape) {
  std::ostringstream out;
  out << shape;
  return out.str();
}

void check_keys(const torch::nn::Module& model, const std::set<std::string>& given,
                const char* op) {
  std::set<std::string> expected;
  for (const auto& p : model.named_parameters()) expected.insert(p.key());
  for (const auto& b : model.named_buffers()) expected.insert(b.key());
  for (const auto& name : expected) {
    if (!given.contains(name))
      throw Error(std::string("mdist: ") + op + ": missing key '" + name + "'");
  }
  for (const auto& name : given) {
    if (!expected.contains(name)) {
      throw Error(std::string("mdist: ") + op + ": unexpected key '" + name + "'");
    }
  }
}

void copy_whole(const std::string& name, at::Tensor target, const at::Tensor& source,
                const char* op) {
  if (!target.sizes().equals(source.sizes())) {
    throw Error(std::string("mdist: ") + op + ": '" + name + "' has shape " +
                shape_text(source.sizes()) + " but the model's is " + shape_text(target.sizes()));
  }
  const at::NoGradGuard no_grad;
  target.copy_(source);
}

}  // namespace

std::map<std::string, ShardedTensor> sharded_state_dict(torch::nn::Module& model) {
  std::map<std::string, ShardedTensor> state;
  for (const auto& item : model.named_parameters()) {
    const auto managed = detail::find_managed(item.value());
    if (!managed) {
      state[item.key()] = {item.value().detach().clone(), item.value().sizes().vec(), 0};
      continue;
    }
    const auto& p = managed->param();
    const auto rows = detail::owned_rows(p, managed->unit->rank);
    state[item.key()] = {p.shard.detach().narrow(0, 0, rows.count).clone(), p.full_shape,
                         rows.first};
  }
  for (const auto& item : model.named_buffers()) {
    state[item.key()] = {item.value().detach().clone(), item.value().sizes().vec(), 0};
  }
  return state;
}

std::map<std::string, ParamPlacement> param_placements(torch::nn::Module& model) {
  std::map<std::string, ParamPlacement> placements;
  for (const auto& item : model.named_parameters()) {
    const auto managed = detail::find_managed(item.value());
    if (!managed) {
      const auto& p = item.value();
      placements[item.key()] = {p, p.sizes().vec(), 0, p.dim() > 0 ? p.size(0) : 1, false};
      continue;
    }
    const auto& p = managed->param();
    const auto rows = detail::owned_rows(p, managed->unit->rank);
    placements[item.key()] = {item.value(), p.full_shape, rows.first, rows.count, true};
  }
  return placements;
}

void load_sharded_state_dict(torch::nn::Module& model,
                             const std::map<std::string, ShardedTensor>& state) {
  constexpr const char* kOp = "load_sharded_state_dict";
  std::set<std::string> given;
  for (const auto& [name, value] : state) given.insert(name);
  check_keys(model, given, kOp);
  const at::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters()) {
    const ShardedTensor& source = state.at(item.key());
    const auto managed = detail::find_managed(item.value());
    if (!managed) {
      copy_whole(item.key(), item.value(), source.local, kOp);
      continue;
    }
    auto& p = managed->param();
    const auto rows = detail::owned_rows(p, managed->unit->rank);
    if (source.full_shape != p.full_shape || source.row_offset != rows.first ||
        (source.local.dim() > 0 ? source.local.size(0) : 1) != rows.count) {
      throw Error(std::string("mdist: ") + kOp + ": '" + item.key() + "' holds rows from " +
                  std::to_string(source.row_offset) + " of shape " + shape_text(source.full_shape) +
                  ", but this rank owns " + std::to_string(rows.count) + " rows from " +
                  std::to_string(rows.first) + " of shape " + shape_text(p.full_shape) +
                  " (sharded state dicts load into the same group size; use the full one "
                  "to change it)");
    }
    if (rows.count > 0) p.shard.narrow(0, 0, rows.count).copy_(source.local);
  }
  for (const auto& item : model.named_buffers()) {
    copy_whole(item.key(), item.value(), state.at(item.key()).local, kOp);
  }
}

std::map<std::string, at::Tensor> full_state_dict(torch::nn::Module& model,
                                                  const FullStateDictOptions& options) {
  std::map<std::string, at::Tensor> state;
  const bool keep = !options.rank0_only || is_master();
  const c10::Device cpu(c10::kCPU);
  std::set<const detail::FsdpUnit*> gathered_units;
  std::map<const at::TensorImpl*, at::Tensor> gathered;  // shard -> full
  // Units are gathered in the order their first parameter appears, the same on every rank.
  for (const auto& item : model.named_parameters()) {
    const auto managed = detail::find_managed(item.value());
    if (!managed || gathered_units.contains(managed->unit.get())) continue;
    gathered_units.insert(managed->unit.get());
    const auto& unit = *managed->unit;
    const auto full =
        unit.gather_full_parameters(options.cpu ? cpu : unit.params.front().shard.device());
    for (std::size_t i = 0; i < unit.params.size(); ++i) {
      gathered[unit.params[i].shard.unsafeGetTensorImpl()] = full[i];
    }
  }
  if (!keep) return state;
  for (const auto& item : model.named_parameters()) {
    const auto it = gathered.find(item.value().unsafeGetTensorImpl());
    at::Tensor value = it != gathered.end() ? it->second : item.value().detach().clone();
    state[item.key()] = options.cpu ? value.to(cpu) : value;
  }
  for (const auto& item : model.named_buffers()) {
    const at::Tensor value = item.value().detach().clone();
    state[item.key()] = options.cpu ? value.to(cpu) : value;
  }
  return state;
}

void load_full_state_dict(torch::nn::Module& model,
                          const std::map<std::string, at::Tensor>& state) {
  constexpr const char* kOp = "load_full_state_dict";
  std::set<std::string> given;
  for (const auto& [name, value] : state) given.insert(name);
  check_keys(model, given, kOp);
  const at::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters()) {
    const at::Tensor& source = state.at(item.key());
    const auto managed = detail::find_managed(item.value());
    if (!managed) {
      copy_whole(item.key(), item.value(), source, kOp);
      continue;
    }
    auto& p = managed->param();
    if (!source.sizes().equals(p.full_shape)) {
      throw Error(std::string("mdist: ") + kOp + ": '" + item.key() + "' has shape " +
                  shape_text(source.sizes()) + " but the model's is " + shape_text(p.full_shape));
    }
    const auto rows = detail::owned_rows(p, managed->unit->rank);
    p.shard.zero_();
    if (rows.count > 0) {
      p.shard.view({p.chunk_rows, p.row_numel})
          .narrow(0, 0, rows.count)
          .copy_(source.reshape({p.rows, p.row_numel}).narrow(0, rows.first, rows.count));
    }
    // A gathered full parameter would now be stale.
    managed->unit->reshard();
  }
  for (const auto& item : model.named_buffers())
    copy_whole(item.key(), item.value(), state.at(item.key()), kOp);
}

void load_state_dict_by_rows(torch::nn::Module& model, const RowReader& read) {
  constexpr const char* kOp = "load_state_dict_by_rows";
  constexpr int64_t kChunkBytes = int64_t{16} << 20;
  const at::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters()) {
    const auto managed = detail::find_managed(item.value());
    if (!managed) {
      copy_whole(item.key(), item.value(), read(item.key(), 0, -1), kOp);
      continue;
    }
    auto& p = managed->param();
    const auto rows = detail::owned_rows(p, managed->unit->rank);
    p.shard.zero_();
    // In chunks of about kChunkBytes: what a reader holds for one call (a copy, mapped pages)
    // then stays small next to the shards even for a large embedding.
    const int64_t row_bytes = std::max<int64_t>(1, p.row_numel * p.shard.element_size());
    const int64_t chunk = std::max<int64_t>(1, kChunkBytes / row_bytes);
    for (int64_t done = 0; done < rows.count; done += chunk) {
      const int64_t n = std::min(chunk, rows.count - done);
      const at::Tensor source = read(item.key(), rows.first + done, n);
      if (source.numel() != n * p.row_numel) {
        throw Error(std::string("mdist: ") + kOp + ": rows " + std::to_string(rows.first + done) +
                    ".." + std::to_string(rows.first + done + n) + " of '" + item.key() +
                    "' have " + std::to_string(source.numel()) + " elements, expected " +
                    std::to_string(n * p.row_numel) + " (shape " + shape_text(p.full_shape) + ")");
      }
      p.shard.view({p.chunk_rows, p.row_numel})
          .narrow(0, done, n)
          .copy_(source.reshape({n, p.row_numel}));
    }
    managed->unit->reshard();  // a gathered full parameter would be stale
  }
}

double clip_grad_norm_(torch::nn::Module& model, double max_norm, double norm_type) {
  const bool inf = std::isinf(norm_type);
  if (!inf && norm_type != 2.0) {
    throw Error("mdist: clip_grad_norm_: norm_type must be 2 or infinity, got " +
                std::to_string(norm_type));
  }
  std::optional<Group> group;
  double sharded = 0;     // this rank's shards: summed (or maxed) over the group
  double replicated = 0;  // whole parameters: the same on every rank, counted once
  std::vector<at::Tensor> grads;
  const at::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters()) {
    const at::Tensor grad = item.value().grad();
    if (!grad.defined()) continue;
    grads.push_back(grad);
    const double part =
        inf ? grad.abs().max().item<double>() : grad.to(at::kDouble).pow(2).sum().item<double>();
    const auto managed = detail::find_managed(item.value());
    if (managed) {
      if (group && !(*group == managed->unit->options.group)) {
        throw Error("mdist: clip_grad_norm_: the model's units use different groups");
      }
      group = managed->unit->options.group;
      sharded = inf ? std::max(sharded, part) : sharded + part;
    } else {
      replicated = inf ? std::max(replicated, part) : replicated + part;
    }
  }
  const Group over = group.value_or(Group::world());
  double total = 0;
  if (inf) {
    total = std::max(allreduce(sharded, "max", over), replicated);
  } else {
    total = std::sqrt(allreduce(sharded + (is_master(over) ? replicated : 0.0), "sum", over));
  }
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    for (auto& grad : grads) grad.mul_(coef);
  }
  return total;
}

}  // namespace mdist
