#include "src/cli/model_build.h"

#include <cmath>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include "mdist/hf/pretrained.h"
#include "mdist/quant/readback.h"
#include "mdist/runtime/device.h"
#include "mdist/runtime/runtime.h"
#include "src/cli/session.h"

namespace mdist::cli {

namespace {

void init_weights(hf::CausalLM& model, std::uint64_t seed, double std) {
  const torch::NoGradGuard no_grad;
  torch::manual_seed(seed);
  for (auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    at::Tensor p = item.value();
    const bool norm = name.find("norm.weight") != std::string::npos;
    if (norm) {
      p.fill_(1.0);
    } else if (name.ends_with(".bias")) {
      p.zero_();
    } else {
      p.normal_(0.0, std);
    }
  }
}

}  // namespace

std::optional<MixedPrecisionPolicy> parse_param_dtype(const std::string& name) {
  if (name.empty()) return std::nullopt;
  MixedPrecisionPolicy policy;
  policy.reduce_dtype = at::kFloat;
  if (name == "bf16" || name == "bfloat16") {
    policy.param_dtype = at::kBFloat16;
  } else if (name == "fp32" || name == "float32") {
    policy.param_dtype = at::kFloat;
  } else if (name == "fp16" || name == "float16") {
    throw InputError("--param-dtype " + name +
                     " needs loss scaling, which mdist train does not do; use bf16");
  } else {
    throw InputError(
        "--param-dtype must be bf16 or fp32 (or left out: compute in the weights' "
        "dtype), got '" +
        name + "'");
  }
  return policy;
}

std::string describe_mixed_precision(const MixedPrecisionPolicy& policy, hf::CausalLM& model) {
  const auto name = [](c10::ScalarType t) -> std::string {
    return t == at::kBFloat16 ? "bf16" : t == at::kFloat ? "fp32" : c10::toString(t);
  };
  return "mixed precision: gathered and computed in " +
         name(policy.param_dtype.value_or(at::kFloat)) + ", gradients reduced in " +
         name(policy.reduce_dtype.value_or(at::kFloat)) + ", weights (and AdamW state) in " +
         name(model->parameters().front().scalar_type()) + " (--param-dtype)";
}

std::unique_ptr<quant::ModelQuantizers> checkpoint_quantizers(const ModelChoice& choice,
                                                              const hf::ParallelModel& built) {
  if (!choice.dir || !choice.quantization) return nullptr;
  hf::CausalLM model = built.model;
  return quant::apply_checkpoint_quantization(model, *choice.dir, built.parallelism);
}

hf::ParallelModel build_wrapped_model(const ModelChoice& choice, std::uint64_t seed,
                                      const JobLayout& layout,
                                      const std::optional<MixedPrecisionPolicy>& mp_policy,
                                      const hf::ActivationCheckpointing& activation_checkpointing) {
  const ParallelState& parallel = layout.parallel;
  // A checkpoint is loaded without ever holding the whole model: built on the meta device,
  // split and wrapped, then each rank reads only its rows from the memory-mapped safetensors.
  if (choice.dir) {
    hf::Fsdp2LoadOptions options;
    options.parallel = parallel;
    options.expert_data_parallel = layout.expert_data_parallel;
    options.mp_policy = mp_policy;
    hf::ParallelModel loaded = hf::load_pretrained_fsdp2(*choice.dir, options);
    hf::CausalLM model = loaded.model;
    // The loader builds and wraps in one call; the mark is read at each forward, so marking
    // after the wrap checkpoints exactly as marking before it.
    hf::apply_activation_checkpointing(model, activation_checkpointing);
    // A NaN or infinite weight makes every number after it meaningless (exit code 0 with a
    // "loss nan"): each rank checks the values it holds, and the ranks agree, so that the job
    // ends with one line before any output exists.
    agree_on_inputs([&] {
      const torch::NoGradGuard no_grad;
      for (const auto& item : model->named_parameters()) {
        if (!at::isfinite(item.value()).all().item<bool>()) {
          throw InputError("model directory '" + choice.dir->string() + "': '" + item.key() +
                           "' holds non-finite values (nan or inf)");
        }
      }
    });
    return loaded;
  }
  hf::CausalLM model(choice.config);
  const auto config = nlohmann::json::parse(choice.config.source_json, nullptr, false);
  const double std = config.is_object() ? config.value("initializer_range", 0.02) : 0.02;
  // On the CPU and whole: the same numbers whatever the device and the layout. (The seeded
  // default is small; a large model comes from a checkpoint, read by slice.)
  init_weights(model, seed, std);
  hf::apply_activation_checkpointing(model, activation_checkpointing);
  std::optional<c10::Device> device;
  if (const auto compute = compute_device(); !compute.is_cpu()) device = compute;
  const hf::Parallelism parallelism =
      hf::apply_parallelism(model, {parallel, layout.expert_data_parallel},
                            {.fsdp = true,
                             .shard_root = true,
                             .mp_policy = mp_policy,
                             .cpu_offload = false,
                             .device = device});
  return {model, parallelism};
}

}  // namespace mdist::cli
