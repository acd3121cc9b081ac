// save_pretrained / load_pretrained: config.json and safetensors in a checkpoint directory.
#include "mdist/hf/pretrained.h"

#include <map>
#include <string>

#include "mdist/error.h"
#include "mdist/fsdp/fully_shard.h"
#include "mdist/fsdp/state_dict.h"
#include "mdist/hf/safetensors.h"
#include "mdist/runtime/runtime.h"

namespace mdist::hf {

void save_pretrained(CausalLM& model, const std::filesystem::path& dir,
                     std::uint64_t max_shard_bytes) {
  std::map<std::string, at::Tensor> tensors;
  if (is_fsdp2_model(*model)) {
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
  const SafetensorsCheckpoint checkpoint(dir);
  load_state_dict_by_rows(model, [&](const std::string& name, int64_t first_row, int64_t rows) {
    if (!checkpoint.contains(name)) {
      throw Error("mdist: load_checkpoint_sharded: '" + dir.string() + "' has no tensor '" + name +
                  "'");
    }
    return rows < 0 ? checkpoint.tensor(name) : checkpoint.read_rows(name, first_row, rows);
  });
}

}  // namespace mdist::hf
