// save_pretrained / load_pretrained: config.json and safetensors in a checkpoint directory.
#include "mdist/hf/pretrained.h"

#include <exception>
#include <map>
#include <string>

#include "mdist/error.h"
#include "mdist/fsdp/fully_shard.h"
#include "mdist/fsdp/state_dict.h"
#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/hf/safetensors.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"

namespace mdist::hf {

void save_pretrained(CausalLM& model, const std::filesystem::path& dir,
                     std::uint64_t max_shard_bytes) {
  std::map<std::string, at::Tensor> tensors;
  const auto& plan = model->tensor_parallel;
  if (plan && plan->size() > 1) {
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
  if (!is_master()) return;
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    throw Error("mdist: save_pretrained: cannot create '" + dir.string() + "': " + error.message());
  }
  save_checkpoint(dir, tensors, max_shard_bytes);
  write_file_atomically(dir / "config.json", model->config.to_json());
}

CausalLM load_pretrained(const std::filesystem::path& dir) {
  const LlamaConfig config = LlamaConfig::from_file((dir / "config.json").string());
  CausalLM model(config);
  const SafetensorsCheckpoint checkpoint(dir);
  std::map<std::string, at::Tensor> tensors;
  for (const auto& name : checkpoint.names()) tensors[name] = checkpoint.tensor(name);
  load_state_dict(model, tensors);
  return model;
}

void load_checkpoint_sharded(torch::nn::Module& model, const std::filesystem::path& dir) {
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
  RowSource source;
  source.keys = [&] {
    std::vector<std::string> keys = checkpoint.names();
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
  source.shape = [&](const std::string& name) { return checkpoint.info(name).shape; };
  source.read = [&](const std::string& name, int64_t first_row, int64_t rows) {
    if (rows < 0) return checkpoint.tensor(name);
    at::Tensor own = checkpoint.read_rows(name, first_row, rows);
    // The rows are copied out: their mapped pages need not stay resident, so a rank's memory
    // stays its shards plus one tensor's rows rather than growing by every row it read.
    checkpoint.release_pages(name);
    return own;
  };
  const auto* causal_lm = dynamic_cast<const CausalLMImpl*>(&model);
  if (causal_lm != nullptr && causal_lm->tensor_parallel) {
    load_state_dict_by_rows(model, causal_lm->tensor_parallel->local_source(std::move(source)));
  } else {
    load_state_dict_by_rows(model, source);
  }
}

CausalLM load_pretrained_fsdp2(const std::filesystem::path& dir, const Fsdp2LoadOptions& options) {
  CausalLM model{nullptr};
  std::exception_ptr failure;
  try {
    CausalLM built(LlamaConfig::from_file((dir / "config.json").string()), c10::kMeta);
    if (options.parallel.tensor_parallel_group.world_size() > 1) {
      parallelize(built, options.parallel);
    }
    fsdp2_wrap(*built, options.shard_root, options.mp_policy, options.cpu_offload,
               options.parallel.data_parallel_group.group());
    load_checkpoint_sharded(*built, dir);
    model = std::move(built);
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
