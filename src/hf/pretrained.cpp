// save_pretrained / load_pretrained: config.json and safetensors in a checkpoint directory.
#include "mdist/hf/pretrained.h"

#include <algorithm>
#include <exception>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "mdist/error.h"
#include "mdist/fsdp/fully_shard.h"
#include "mdist/fsdp/state_dict.h"
#include "mdist/hf/expert_parallel.h"
#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/hf/quantized_checkpoint.h"
#include "mdist/hf/safetensors.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/c10d.h"
#include "mdist/runtime/device.h"
#include "mdist/runtime/runtime.h"
#include "src/hf/dtypes.h"

namespace mdist::hf {
namespace {

std::string shape_text(c10::IntArrayRef shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return text + "]";
}

std::string first_of(const std::vector<std::string>& items) {
  std::string text;
  for (std::size_t i = 0; i < items.size() && i < 3; ++i) text += (i ? ", " : "") + items[i];
  if (items.size() > 3) text += " and " + std::to_string(items.size() - 3) + " more";
  return text;
}

// A mixture of experts' parameters held in transformers 5's fused tensors, by parameter name
// (hf::expert_slices), with the fused key; empty for a dense model or per-expert checkpoint.
struct FusedParam {
  std::string key;
  ExpertSlice slice;
  std::vector<int64_t> shape;  // the parameter's
};
std::map<std::string, FusedParam> fused_params(const LlamaConfig& config,
                                               const SafetensorsCheckpoint& checkpoint) {
  std::map<std::string, FusedParam> fused;
  if (!config.moe) return fused;
  for (const auto& key : checkpoint.names()) {
    const auto& shape = checkpoint.info(key).shape;
    for (const auto& slice : expert_slices(config, key, shape)) {
      std::vector<int64_t> own = shape;
      if (slice.expert >= 0) own = {slice.rows, shape.back()};
      fused[slice.name] = {key, slice, own};
    }
  }
  return fused;
}

}  // namespace

std::vector<std::string> check_checkpoint(const LlamaConfig& config,
                                          const SafetensorsCheckpoint& checkpoint) {
  // A quantized checkpoint is read only in the formats whose weights this loader dequantizes.
  const auto quantization = checkpoint_quantization(checkpoint.dir());
  if (const auto& q = quantization; q && !is_readable(*q)) {
    throw Error("quantized with quant_algo " + q->quant_algo +
                (q->kv_cache_quant_algo ? " and kv_cache_quant_algo " + *q->kv_cache_quant_algo
                                        : std::string()) +
                " (" + q->source + "); reading back is implemented for " + kReadableQuantAlgos +
                " with no KV-cache quantization or an FP8 one only");
  }
  // The model's own names and full shapes, from a model on the meta device (no memory).
  const CausalLM meta(config, c10::kMeta);
  const auto params = meta->named_parameters();
  const auto fused = fused_params(config, checkpoint);
  std::set<std::string> fused_keys;
  for (const auto& [name, f] : fused) fused_keys.insert(f.key);
  std::vector<std::string> missing, unexpected;
  for (const auto& item : params) {
    const std::string& name = item.key();
    const auto in_fused = fused.find(name);
    if (!checkpoint.contains(name) && in_fused == fused.end()) {
      missing.push_back(name);
      continue;
    }
    TensorInfo info =
        checkpoint.contains(name) ? checkpoint.info(name) : checkpoint.info(in_fused->second.key);
    if (!checkpoint.contains(name)) info.shape = in_fused->second.shape;
    if (checkpoint.contains(name)) info.shape = detail::model_shape(checkpoint, name);
    if (!c10::IntArrayRef(info.shape).equals(item.value().sizes())) {
      throw Error("size mismatch for '" + name + "': copying a param with shape " +
                  shape_text(info.shape) + " from checkpoint, the shape in current model is " +
                  shape_text(item.value().sizes()));
    }
    // A quantized weight must be stored as its quant_algo stores it (an FP8 weight under an
    // NVFP4 label would be read with the wrong arithmetic).
    if (quantization && detail::is_quantized_weight(checkpoint, name) &&
        info.dtype != detail::stored_weight_dtype(quantization->quant_algo)) {
      throw Error("'" + name + "' is stored as " + dtype_name(info.dtype) + ", but quant_algo " +
                  quantization->quant_algo + " stores its weights as " +
                  dtype_name(detail::stored_weight_dtype(quantization->quant_algo)));
    }
    // A quantized Linear's weight (int8 or fp8 with its weight_scale) is read dequantized.
    if (!c10::isFloatingType(info.dtype) && !detail::is_quantized_weight(checkpoint, name)) {
      throw Error("'" + name + "' is stored as " + dtype_name(info.dtype) +
                  "; only floating-point tensors convert to the model's " +
                  detail::dtype_name(item.value().scalar_type()) + " parameters");
    }
  }
  if (!missing.empty()) {
    throw Error("the checkpoint has no " + first_of(missing) + " (" +
                std::to_string(missing.size()) + " of the model's " +
                std::to_string(params.size()) + " parameters missing)");
  }
  for (const auto& name : checkpoint.names()) {
    if (params.contains(name) || fused_keys.contains(name)) continue;
    if (detail::is_quantization_scale(checkpoint, name)) continue;
    if (name == "lm_head.weight" && config.tie_word_embeddings) {
      // A tied model's head is its embedding: a listed copy must at least fit it.
      const auto& embed = params["model.embed_tokens.weight"];
      if (!c10::IntArrayRef(checkpoint.info(name).shape).equals(embed.sizes())) {
        throw Error("size mismatch for 'lm_head.weight': copying a param with shape " +
                    shape_text(checkpoint.info(name).shape) +
                    " from checkpoint, the shape in current model (tied to "
                    "model.embed_tokens.weight) is " +
                    shape_text(embed.sizes()));
      }
      continue;
    }
    unexpected.push_back(name);
  }
  return unexpected;
}

namespace {

// The bytes of a tensor as a 1-D uint8 tensor, so that any dtype travels bit for bit.
at::Tensor bytes_of(const at::Tensor& tensor) {
  return tensor.contiguous().reshape({-1}).view(at::kByte);
}

// Under expert parallelism, on the ranks of the expert-parallel group `group` holding world
// rank 0: `local` holds this rank's experts whole (on rank 0 also the rest of the model); on
// rank 0 the result adds every other rank's experts under their global names (the other ranks
// get an empty dict). Each expert tensor is gathered to rank 0 on its own, as bytes: the other
// ranks only send, dropping each tensor once it is sent, and never hold another rank's
// experts. Collective over `group`.
std::map<std::string, at::Tensor> gather_experts(CausalLM& model,
                                                 std::map<std::string, at::Tensor> local,
                                                 const Group& group) {
  constexpr const char* kOp = "mdist: save_pretrained";
  const std::vector<int> members = group.ranks();
  const int root = static_cast<int>(std::find(members.begin(), members.end(), 0) - members.begin());
  const int me = rank(group);
  const int ranks = static_cast<int>(members.size());
  // One entry per expert tensor, in the same order on every rank. Every rank must hold as
  // many experts of the same shapes and dtypes: checked on all ranks alike before anything is
  // gathered, as a mismatch would pair unrelated tensors or leave a rank waiting.
  struct Entry {
    std::string prefix;  // the block's experts
    int64_t index;       // within this rank's experts of the block
    int64_t count;       // experts per rank in the block
    std::string param;   // within the expert ("gate_proj.weight")
    std::string name(int r) const {
      return prefix + "." + std::to_string(r * count + index) + "." + param;
    }
  };
  std::vector<Entry> entries;
  std::string signature;
  std::optional<std::string> problem;
  for (const auto& [prefix, experts] : named_experts(model)) {
    const auto count = static_cast<int64_t>(experts->local.size());
    // parallelize_experts gives group rank r experts [r E/ep, (r+1) E/ep): the names of the
    // other ranks' tensors are computed from that.
    if (experts->first != me * count && !problem) {
      problem = "'" + prefix + "' holds experts from " + std::to_string(experts->first) +
                " on rank " + std::to_string(me) + " of " + group.name() + ", not from " +
                std::to_string(me * count);
    }
    for (int64_t i = 0; i < count; ++i) {
      for (const auto& param : experts->local[static_cast<std::size_t>(i)]->named_parameters()) {
        Entry entry{prefix, i, count, param.key()};
        const auto it = local.find(entry.name(me));
        if (it == local.end()) {
          if (!problem) problem = "'" + entry.name(me) + "' was not gathered";
          continue;
        }
        signature += prefix + "[" + std::to_string(i) + "]." + param.key() +
                     shape_text(it->second.sizes()) + detail::dtype_name(it->second.scalar_type()) +
                     ";";
        entries.push_back(std::move(entry));
      }
    }
  }
  const auto problems = allgather(problem, group);
  const auto signatures = allgather(signature, group);
  for (int r = 0; r < ranks; ++r) {
    const auto& theirs = problems[static_cast<std::size_t>(r)];
    if (theirs) throw Error(std::string(kOp) + ": " + *theirs);
    if (signatures[static_cast<std::size_t>(r)] != signature) {
      throw Error(std::string(kOp) + ": the ranks of " + group.name() +
                  " do not hold experts of the same count, shapes and dtypes (group rank " +
                  std::to_string(r) + " differs from group rank " + std::to_string(me) + ")");
    }
  }
  const auto pg = process_group(group);
  const c10::Device device = compute_device();
  c10d::GatherOptions options;
  options.rootRank = root;
  options.timeout = group.timeout();
  std::map<std::string, at::Tensor> whole;
  for (const Entry& entry : entries) {
    const auto it = local.find(entry.name(me));
    const at::Tensor mine = it->second;
    if (me != root) {
      if (mine.numel() > 0) {
        std::vector<std::vector<at::Tensor>> none;
        std::vector<at::Tensor> input = {bytes_of(mine.to(device))};
        wait(pg->gather(none, input, options), group, "save_pretrained (experts)");
      }
      local.erase(it);  // sent: this rank no longer holds it
      continue;
    }
    std::vector<std::vector<at::Tensor>> received(1);
    std::vector<at::Tensor> input = {bytes_of(mine.to(device))};
    for (int r = 0; r < ranks; ++r) {
      received[0].push_back(at::empty_like(input[0]));
    }
    if (mine.numel() > 0) {
      wait(pg->gather(received, input, options), group, "save_pretrained (experts)");
    }
    for (int r = 0; r < ranks; ++r) {
      if (r == root) continue;
      whole[entry.name(r)] = received[0][static_cast<std::size_t>(r)]
                                 .to(mine.device())
                                 .view(mine.scalar_type())
                                 .view(mine.sizes());
    }
  }
  if (me != root) return {};
  whole.merge(local);
  return whole;
}

}  // namespace

void save_pretrained(CausalLM& model, const std::filesystem::path& dir,
                     std::uint64_t max_shard_bytes) {
  if (is_tensor_parallel_split(model) || is_expert_parallel_split(model)) {
    throw Error(
        "mdist: save_pretrained: the model is split; pass the Parallelism "
        "apply_parallelism returned");
  }
  save_pretrained(model, Parallelism{}, dir, max_shard_bytes);
}

std::map<std::string, at::Tensor> whole_parameters(CausalLM& model,
                                                   const Parallelism& parallelism) {
  std::map<std::string, at::Tensor> tensors;
  const auto& plan = parallelism.tensor_parallel;
  if (parallelism.expert_parallel) {
    const Group& expert_parallel = parallelism.expert_parallel->group();
    // The ranks of the expert-parallel group holding rank 0 gather their own experts whole (the
    // FSDP gather is over their expert-data-parallel groups), rank 0 also the rest of the
    // model; then rank 0 collects the others' experts over the expert-parallel group.
    const std::vector<int> members = expert_parallel.ranks();
    const bool holds_rank0 = std::find(members.begin(), members.end(), 0) != members.end();
    std::set<std::string> experts;
    for (const auto& [prefix, module] : named_experts(model)) {
      for (const auto& param : module->named_parameters()) {
        experts.insert(prefix + "." + param.key());
      }
    }
    const auto needed = [&](const std::string& name) {
      return is_master() || experts.contains(name);
    };
    std::map<std::string, at::Tensor> local;
    if (is_fsdp2_model(*model)) {
      local = full_state_dict(*model, {.cpu = true, .keep = holds_rank0, .only = needed});
    } else if (holds_rank0) {
      for (const auto& item : model->named_parameters()) {
        if (needed(item.key())) local[item.key()] = item.value().detach();
      }
    }
    if (holds_rank0) tensors = gather_experts(model, std::move(local), expert_parallel);
  } else if (plan && plan->size() > 1) {
    // Each tensor-parallel rank of the group holding rank 0 gathers its own part whole, then
    // the parts are joined into the HF layout on rank 0.
    std::map<std::string, at::Tensor> local;
    if (is_fsdp2_model(*model)) {
      local = full_state_dict(*model, {.cpu = true, .keep = plan->holds_global_rank0()});
    } else if (plan->holds_global_rank0()) {
      for (const auto& item : model->named_parameters()) local[item.key()] = item.value().detach();
    }
    if (plan->holds_global_rank0()) tensors = plan->gather(local);
  } else if (is_fsdp2_model(*model)) {
    tensors = full_state_dict(*model, {.rank0_only = true, .cpu = true});
  } else if (is_master()) {
    for (const auto& item : model->named_parameters()) tensors[item.key()] = item.value().detach();
  }
  return tensors;
}

void save_pretrained(CausalLM& model, const Parallelism& parallelism,
                     const std::filesystem::path& dir, std::uint64_t max_shard_bytes) {
  const std::map<std::string, at::Tensor> tensors = whole_parameters(model, parallelism);
  if (!is_master()) return;
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    throw Error("mdist: save_pretrained: cannot create '" + dir.string() + "': " + error.message());
  }
  save_checkpoint(dir, tensors, max_shard_bytes);
  // config.json names the dtype the tensors were written in (the model's, which may differ
  // from the dtype of the checkpoint it was loaded from: a bf16 checkpoint is trained in fp32),
  // so that from_pretrained(dtype="auto") and the tensors agree.
  LlamaConfig written = model->config;
  written.torch_dtype = detail::dtype_name(detail::dominant_dtype(
      tensors, [](const auto& item) -> const at::Tensor& { return item.second; }));
  write_file_atomically(dir / "config.json", written.to_json());
}

namespace {

// check_checkpoint, with dir in the message; the keys to ignore, reported once.
std::set<std::string> checked_extra_keys(const LlamaConfig& config,
                                         const SafetensorsCheckpoint& checkpoint,
                                         const std::filesystem::path& dir) {
  std::vector<std::string> extra;
  try {
    extra = check_checkpoint(config, checkpoint);
  } catch (const Error& error) {
    throw Error("mdist: checkpoint '" + dir.string() + "': " + error.what());
  }
  if (!extra.empty() && is_master()) {
    std::cerr << "mdist: checkpoint '" << dir.string() << "': ignoring " << extra.size()
              << " tensor(s) the model does not have: " << first_of(extra) << std::endl;
  }
  return {extra.begin(), extra.end()};
}

}  // namespace

CausalLM load_pretrained(const std::filesystem::path& dir) {
  const LlamaConfig config = LlamaConfig::from_file((dir / "config.json").string());
  CausalLM model(config);
  const SafetensorsCheckpoint checkpoint(dir);
  const auto extra = checked_extra_keys(config, checkpoint, dir);
  std::map<std::string, at::Tensor> tensors;
  for (const auto& name : checkpoint.names()) {
    if (extra.contains(name) || detail::is_quantization_scale(checkpoint, name)) continue;
    tensors[name] = detail::is_quantized_weight(checkpoint, name)
                        ? detail::dequantized_rows(checkpoint, name, 0, -1)
                        : checkpoint.tensor(name);
  }
  load_state_dict(model, tensors);
  return model;
}

namespace {

// load_checkpoint_sharded, through `plan` when the model is split over a tensor-parallel group.
void load_sharded(torch::nn::Module& model, const TensorParallelPlan* plan,
                  const std::filesystem::path& dir) {
  // A copy into a meta tensor does nothing, silently: the model would keep no values at all.
  for (const auto& item : model.named_parameters()) {
    if (item.value().is_meta()) {
      throw Error("mdist: load_checkpoint_sharded: '" + item.key() +
                  "' is on the meta device and has no storage to load into; wrap the model "
                  "with fsdp2_wrap first (it gives shards and whole parameters real memory), or "
                  "materialise it with mdist::nn::to_empty");
    }
  }
  const SafetensorsCheckpoint checkpoint(dir);
  const auto params = model.named_parameters();
  const auto* causal_lm = dynamic_cast<const CausalLMImpl*>(&model);
  // A CausalLM is checked against its config's full shapes (a split model's parameters are
  // slices), and tensors it does not have are skipped as transformers skips them.
  const std::set<std::string> extra = causal_lm != nullptr
                                          ? checked_extra_keys(causal_lm->config, checkpoint, dir)
                                          : std::set<std::string>{};
  RowSource source;
  source.keys = [&] {
    std::vector<std::string> keys = checkpoint.names();
    std::erase_if(keys, [&](const std::string& key) {
      return extra.contains(key) || detail::is_quantization_scale(checkpoint, key);
    });
    // A tied model's lm_head.weight is embed_tokens.weight: a listed copy is accepted and
    // ignored, as hf::load_state_dict does.
    if (!params.contains("lm_head.weight") && params.contains("model.embed_tokens.weight") &&
        checkpoint.contains("model.embed_tokens.weight")) {
      std::erase_if(keys, [&](const std::string& key) {
        return key == "lm_head.weight" &&
               c10::IntArrayRef(checkpoint.info(key).shape)
                   .equals(c10::IntArrayRef(checkpoint.info("model.embed_tokens.weight").shape));
      });
    }
    return keys;
  };
  // A mixture of experts in transformers 5's fused layout: each expert's parameter is read
  // from its rows of the fused tensor.
  const auto fused = causal_lm != nullptr ? fused_params(causal_lm->config, checkpoint)
                                          : std::map<std::string, FusedParam>{};
  if (!fused.empty()) {
    auto keys = source.keys;
    source.keys = [&fused, keys] {
      std::set<std::string> fused_keys;
      for (const auto& [name, f] : fused) fused_keys.insert(f.key);
      std::vector<std::string> out = keys();
      std::erase_if(out, [&](const std::string& key) { return fused_keys.contains(key); });
      for (const auto& [name, f] : fused) out.push_back(name);
      return out;
    };
  }
  // Under expert parallelism (hf::parallelize_experts) the checkpoint, checked above against
  // the full config, holds every expert; this rank reads only its own and skips the others.
  bool split_experts = false;
  if (causal_lm != nullptr) {
    for (const auto& layer : causal_lm->model->decoder_layers) {
      split_experts =
          split_experts || (layer->moe && static_cast<int64_t>(layer->moe->experts->local.size()) !=
                                              layer->moe->experts->num_experts);
    }
  }
  if (split_experts) {
    auto keys = source.keys;
    source.keys = [&params, keys] {
      std::vector<std::string> out = keys();
      std::erase_if(out, [&](const std::string& key) {
        return key.find(".experts.") != std::string::npos && !params.contains(key);
      });
      return out;
    };
  }
  source.shape = [&](const std::string& name) {
    if (const auto it = fused.find(name); it != fused.end()) return it->second.shape;
    return detail::model_shape(checkpoint, name);
  };
  source.read = [&](const std::string& name, int64_t first_row, int64_t rows) {
    if (const auto it = fused.find(name); it != fused.end()) {
      const ExpertSlice& s = it->second.slice;
      const at::Tensor whole = s.expert < 0 ? checkpoint.tensor(it->second.key)
                                            : checkpoint.read_rows(it->second.key, s.expert, 1)[0];
      const at::Tensor own = whole.slice(0, s.first_row, s.first_row + s.rows);
      return (rows < 0 ? own : own.slice(0, first_row, first_row + rows)).clone();
    }
    if (detail::is_quantized_weight(checkpoint, name)) {
      return detail::dequantized_rows(checkpoint, name, first_row, rows);
    }
    if (rows < 0) return checkpoint.tensor(name);
    at::Tensor own = checkpoint.read_rows(name, first_row, rows);
    // The rows are copied out: their mapped pages need not stay resident, so a rank's memory
    // stays its shards plus one tensor's rows rather than growing by every row it read.
    checkpoint.release_pages(name);
    return own;
  };
  if (plan != nullptr) {
    load_state_dict_by_rows(model, plan->local_source(std::move(source)));
  } else {
    load_state_dict_by_rows(model, source);
  }
}

}  // namespace

void load_checkpoint_sharded(torch::nn::Module& model, const std::filesystem::path& dir) {
  const auto* causal_lm = dynamic_cast<const CausalLMImpl*>(&model);
  if (causal_lm != nullptr &&
      causal_lm->model->embed_tokens->options.num_embeddings() != causal_lm->config.vocab_size) {
    throw Error(
        "mdist: load_checkpoint_sharded: the model is split over a tensor-parallel "
        "group; pass the Parallelism apply_parallelism returned");
  }
  load_sharded(model, nullptr, dir);
}

void load_checkpoint_sharded(CausalLM& model, const Parallelism& parallelism,
                             const std::filesystem::path& dir) {
  load_sharded(*model, parallelism.tensor_parallel.get(), dir);
}

ParallelModel load_pretrained_fsdp2(const std::filesystem::path& dir,
                                    const Fsdp2LoadOptions& options) {
  ParallelModel model;
  std::exception_ptr failure;
  try {
    CausalLM built(LlamaConfig::from_file((dir / "config.json").string()), c10::kMeta);
    if (options.parallel.expert_model_parallel_group.world_size() > 1 &&
        !options.expert_data_parallel) {
      throw Error(
          "mdist: load_pretrained_fsdp2: an expert-parallel layout needs "
          "Fsdp2LoadOptions::expert_data_parallel (make_expert_data_parallel_group)");
    }
    const Parallelism parallelism =
        apply_parallelism(built, {options.parallel, options.expert_data_parallel},
                          {.fsdp = true,
                           .shard_root = options.shard_root,
                           .mp_policy = options.mp_policy,
                           .cpu_offload = options.cpu_offload});
    load_checkpoint_sharded(built, parallelism, dir);
    model = {std::move(built), parallelism};
  } catch (...) {
    failure = std::current_exception();
  }
  // Nothing above communicates, so a rank that failed alone would leave the others to hang
  // in their first all-gather: agree on the outcome first.
  const int failed_ranks = allreduce(failure ? 1 : 0, "sum");
  if (failure) std::rethrow_exception(failure);
  if (failed_ranks > 0) {
    throw Error("mdist: load_pretrained_fsdp2: '" + dir.string() +
                "': " + std::to_string(failed_ranks) + " other rank(s) failed to load it");
  }
  return model;
}

}  // namespace mdist::hf
