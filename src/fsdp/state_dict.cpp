// Sharded and full state dicts of wrapped models, and loading by rows.
#include "mdist/fsdp/state_dict.h"

#include <set>
#include <sstream>

#include "mdist/error.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"
#include "src/fsdp/fsdp_state.h"

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
    const auto rows = p.owned(managed->unit->rank);
    state[item.key()] = {item.value().detach().narrow(0, 0, rows.count).clone(), p.full_shape(),
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
    const auto rows = p.owned(managed->unit->rank);
    placements[item.key()] = {item.value(), p.full_shape(), rows.first, rows.count, true};
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
    const auto& p = managed->param();
    const auto rows = p.owned(managed->unit->rank);
    if (source.full_shape != p.full_shape() || source.row_offset != rows.first ||
        (source.local.dim() > 0 ? source.local.size(0) : 1) != rows.count) {
      throw Error(std::string("mdist: ") + kOp + ": '" + item.key() + "' holds rows from " +
                  std::to_string(source.row_offset) + " of shape " + shape_text(source.full_shape) +
                  ", but this rank owns " + std::to_string(rows.count) + " rows from " +
                  std::to_string(rows.first) + " of shape " + shape_text(p.full_shape()) +
                  " (sharded state dicts load into the same group size; use the full one "
                  "to change it)");
    }
    if (rows.count > 0) item.value().narrow(0, 0, rows.count).copy_(source.local);
    managed->unit->invalidate();  // a gathered full parameter would be stale
  }
  for (const auto& item : model.named_buffers()) {
    copy_whole(item.key(), item.value(), state.at(item.key()).local, kOp);
  }
}

std::map<std::string, at::Tensor> full_state_dict(torch::nn::Module& model,
                                                  const FullStateDictOptions& options) {
  std::map<std::string, at::Tensor> state;
  const bool keep = options.keep.value_or(!options.rank0_only || is_master());
  const auto wanted = [&](const std::string& name) {
    return keep && (!options.only || options.only(name));
  };
  // The parameters this rank keeps: every other gathered tensor is dropped as soon as its
  // unit's gather returns, so a rank that keeps nothing never holds more than one unit whole.
  std::set<const at::TensorImpl*> kept;
  for (const auto& item : model.named_parameters()) {
    if (wanted(item.key())) kept.insert(item.value().unsafeGetTensorImpl());
  }
  const c10::Device cpu(c10::kCPU);
  std::set<const detail::FsdpParamGroup*> gathered_units;
  std::map<const at::TensorImpl*, at::Tensor> gathered;  // shard -> full
  // Units are gathered in the order their first parameter appears, the same on every rank.
  for (const auto& item : model.named_parameters()) {
    const auto managed = detail::find_managed(item.value());
    if (!managed || gathered_units.contains(managed->unit.get())) continue;
    gathered_units.insert(managed->unit.get());
    const auto& unit = *managed->unit;
    const auto full = unit.gather_full_parameters(options.cpu ? cpu : unit.shard_device);
    for (std::size_t i = 0; i < unit.params.size(); ++i) {
      if (kept.contains(unit.params[i].shard_key())) gathered[unit.params[i].shard_key()] = full[i];
    }
  }
  if (!keep) return state;
  for (const auto& item : model.named_parameters()) {
    if (!wanted(item.key())) continue;
    const auto it = gathered.find(item.value().unsafeGetTensorImpl());
    at::Tensor value = it != gathered.end() ? it->second : item.value().detach().clone();
    state[item.key()] = options.cpu ? value.to(cpu) : value;
  }
  for (const auto& item : model.named_buffers()) {
    if (!wanted(item.key())) continue;
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
    const auto& p = managed->param();
    if (!source.sizes().equals(p.full_shape())) {
      throw Error(std::string("mdist: ") + kOp + ": '" + item.key() + "' has shape " +
                  shape_text(source.sizes()) + " but the model's is " + shape_text(p.full_shape()));
    }
    const auto rows = p.owned(managed->unit->rank);
    at::Tensor shard = item.value();
    shard.zero_();
    if (rows.count > 0) {
      shard.view({p.chunk_rows(), p.row_numel()})
          .narrow(0, 0, rows.count)
          .copy_(source.reshape({p.rows(), p.row_numel()}).narrow(0, rows.first, rows.count));
    }
    managed->unit->invalidate();  // a gathered full parameter would be stale
  }
  for (const auto& item : model.named_buffers())
    copy_whole(item.key(), item.value(), state.at(item.key()), kOp);
}

void load_state_dict_by_rows(torch::nn::Module& model, const RowSource& source) {
  constexpr const char* kOp = "load_state_dict_by_rows";
  constexpr int64_t kChunkBytes = int64_t{16} << 20;
  const auto keys = source.keys();
  check_keys(model, std::set<std::string>(keys.begin(), keys.end()), kOp);
  // Every shape before any value: a bad checkpoint changes nothing.
  const auto params = model.named_parameters();
  const auto buffers = model.named_buffers();
  const auto check_shape = [&](const std::string& name, c10::IntArrayRef expected) {
    const std::vector<int64_t> shape = source.shape(name);
    if (!c10::IntArrayRef(shape).equals(expected)) {
      throw Error(std::string("mdist: ") + kOp + ": size mismatch for '" + name +
                  "': copying a param with shape " + shape_text(shape) +
                  " from checkpoint, the shape in current model is " + shape_text(expected));
    }
  };
  for (const auto& item : params) {
    const auto managed = detail::find_managed(item.value());
    check_shape(item.key(),
                managed ? c10::IntArrayRef(managed->param().full_shape()) : item.value().sizes());
  }
  for (const auto& item : buffers) check_shape(item.key(), item.value().sizes());

  const at::NoGradGuard no_grad;
  for (const auto& item : params) {
    const auto managed = detail::find_managed(item.value());
    if (!managed) {
      copy_whole(item.key(), item.value(), source.read(item.key(), 0, -1), kOp);
      continue;
    }
    const auto& p = managed->param();
    const auto rows = p.owned(managed->unit->rank);
    at::Tensor shard = item.value();
    shard.zero_();
    // In chunks of about kChunkBytes: what a reader holds for one call (a copy, mapped pages)
    // then stays small next to the shards even for a large embedding.
    const int64_t row_bytes = std::max<int64_t>(1, p.row_numel() * shard.element_size());
    const int64_t chunk = std::max<int64_t>(1, kChunkBytes / row_bytes);
    for (int64_t done = 0; done < rows.count; done += chunk) {
      const int64_t n = std::min(chunk, rows.count - done);
      const at::Tensor part = source.read(item.key(), rows.first + done, n);
      if (part.numel() != n * p.row_numel()) {
        throw Error(std::string("mdist: ") + kOp + ": the reader gave rows " +
                    std::to_string(rows.first + done) + ".." +
                    std::to_string(rows.first + done + n) + " of '" + item.key() + "' as " +
                    shape_text(part.sizes()) + ", expected " + std::to_string(n) +
                    " rows of shape " + shape_text(p.full_shape()));
      }
      shard.view({p.chunk_rows(), p.row_numel()})
          .narrow(0, done, n)
          .copy_(part.reshape({n, p.row_numel()}));
    }
    managed->unit->invalidate();  // a gathered full parameter would be stale
  }
  for (const auto& item : buffers) {
    copy_whole(item.key(), item.value(), source.read(item.key(), 0, -1), kOp);
  }
}

}  // namespace mdist
