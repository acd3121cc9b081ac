// See src/cli/train_quant.h.
#include "src/cli/train_quant.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>

#include "mdist/error.h"
#include "mdist/hf/safetensors.h"
#include "mdist/quant/block_check.h"
#include "mdist/quant/export.h"
#include "mdist/quant/kv_cache.h"
#include "mdist/runtime/device.h"
#include "mdist/runtime/runtime.h"
#include "mdist/train/forward_split.h"
#include "src/cli/job_data.h"

namespace mdist::cli {

std::int64_t calibration_sequences(const TrainOptions& o, const Windows& windows) {
  return o.calib_sequences > 0 ? std::min(o.calib_sequences, windows.count()) : windows.count();
}

quant::QuantConfig qat_config(const TrainOptions& o) {
  quant::QuantConfig config = quant::QuantConfig::preset(o.quant);
  config.pass_through_bwd = o.quant_backward != "clipped";
  if (!o.kv_cache.empty()) quant::add_kv_cache_rules(config, o.kv_cache);
  return config;
}

std::string qat_calibration_method(const TrainOptions& o) {
  return quant::QuantConfig::preset(o.quant).algorithm == "awq_lite" ? "AWQ-lite" : "max";
}

namespace {

// Quantization-aware training of a mixture of experts (modelopt's fused experts, see
// mdist/quant/quantize.h) as compared with modelopt's (tests/quant/make_qat_fixtures.py's
// qat_qwen3_moe): fp8 and int8 in fp32, on one rank, FSDP2 and expert parallelism. The rest is
// refused rather than run unverified.
void check_qat_moe(const TrainOptions& o) {
  const std::string moe = "--quant " + o.quant + " on a mixture of experts";
  if (o.quant != "fp8" && o.quant != "int8") {
    throw InputError(moe +
                     ": quantization-aware training of a mixture of experts takes fp8 or "
                     "int8 only yet");
  }
  const char* untested = !o.kv_cache.empty()         ? "--kv-cache"
                         : !o.io.param_dtype.empty() ? "--param-dtype"
                         : o.distill.teacher         ? "--teacher"
                                                     : nullptr;
  if (untested != nullptr) {
    throw InputError(moe + " with " + untested +
                     ": not supported together yet (quantization-aware training of a mixture "
                     "of experts is compared with modelopt in fp32 without them)");
  }
}

}  // namespace

void check_qat_model(const TrainOptions& o, const hf::LlamaConfig& config) {
  if (!o.kv_cache.empty() && config.fused_projections) {
    // mdist::quant refuses it too (kv_cache.h), as `mdist quantize --kv-cache` does.
    throw InputError("--kv-cache " + o.kv_cache +
                     " is not supported for this model: its attention has one fused qkv_proj");
  }
  if (config.moe) check_qat_moe(o);
  // The block formats' shapes, on the meta device: nothing is allocated or loaded.
  hf::CausalLM shapes(config, c10::kMeta);
  if (const auto problem = quant::block_size_problem(shapes, qat_config(o),
                                                     static_cast<int>(o.io.tensor_parallel))) {
    throw InputError("--quant " + o.quant + ": " + *problem);
  }
}

namespace {

// modelopt's AWQ-lite writes W * s into `weight.data` (apply_pre_quant_scale_and_smooth) and
// QAT then trains that parameter; mdist::quant keeps the parameter and scales it in each
// forward (QuantizedLinear::smoothing), which would train W instead, with other gradients.
// So the scale goes into the parameter itself (FSDP2: this rank's dim-0 shard; the scale is
// per input channel, dim 1) and the Linear's smoothing is dropped: the forward then quantizes
// the parameter as it is.
void fold_smoothing_into_parameters(const quant::ModelQuantizers& quantizers) {
  const torch::NoGradGuard no_grad;
  for (const auto& q : quantizers.linears()) {
    if (!q->smoothing.defined()) continue;
    at::Tensor* weight = q->linear->named_parameters(/*recurse=*/false).find("weight");
    if (weight == nullptr) throw Error("mdist train: " + q->name + " has no weight parameter");
    weight->copy_(quant::smoothed_weight(*weight, q->smoothing));
    q->smoothing = at::Tensor();
  }
}

}  // namespace

std::unique_ptr<quant::ModelQuantizers> start_quantization_aware_training(
    const TrainOptions& o, hf::CausalLM& model, const hf::Parallelism& parallelism,
    const JobLayout& layout, const QatCalibration& calibration) {
  const c10::Device device = compute_device();
  // Calibration is forwards only, as modelopt's calibration loop runs under no_grad.
  const torch::NoGradGuard no_grad;
  // One sequence per forward, as `mdist quantize`: a sequence's activations are computed alike
  // whatever the number of ranks, so the amaxes are the same on every data-parallel layout. A
  // rank with no sequence left runs window 0 again (FSDP2's collectives need every rank's
  // forward); max calibration over the group already includes it.
  const quant::ForwardLoop loop = [&](hf::CausalLM& m) {
    const Group dp = layout.parallel.data_parallel_group.group();
    const auto plan =
        train::plan_forwards(calibration.sequences, mdist::size(dp), mdist::rank(dp), 1);
    for (int64_t round = 0; round < plan.rounds; ++round) {
      const bool real = round < static_cast<int64_t>(plan.windows.size());
      // A repeat counts in no mean (AWQ's statistics), as in `mdist quantize`.
      std::optional<quant::UncountedForward> uncounted;
      if (!real) uncounted.emplace();
      m->forward(
          batch_of(calibration.windows, {real ? plan.windows[static_cast<std::size_t>(round)] : 0})
              .to(device));
    }
  };
  // Under --param-dtype the forwards see the gathered weights in that dtype while the shards
  // hold the master weights: the weight amax takes both, as modelopt's on FSDP2.
  auto quantizers = quant::quantize(model, qat_config(o), loop,
                                    {.parallel = layout.parallel,
                                     .parallelism = parallelism,
                                     .expert_data_parallel = layout.expert_data_parallel,
                                     .master_weight_amax = !o.io.param_dtype.empty()});
  fold_smoothing_into_parameters(*quantizers);
  return quantizers;
}

void save_qat_state(const quant::ModelQuantizers& quantizers, const hf::Parallelism& parallelism,
                    const TrainOptions& o, const std::filesystem::path& path) {
  const auto amax = quant::whole_amax_state_dict(quantizers, parallelism);
  if (rank() != 0) return;
  std::map<std::string, at::Tensor> tensors;
  for (const auto& [name, value] : amax) tensors.emplace(name, value.detach().cpu().contiguous());
  // AWQ's input scale (int4_awq, refused with --tp: whole on every rank).
  for (const auto& q : quantizers.linears()) {
    const at::Tensor& scale = q->input_quantizer->pre_quant_scale();
    if (scale.defined()) {
      tensors.emplace(q->name + ".input_quantizer._pre_quant_scale",
                      scale.detach().cpu().contiguous());
    }
  }
  hf::save_safetensors(path, tensors,
                       {{"format", "mdist.qat_quantizers.v1"}, {"quant", describe_qat(o)}});
}

std::unique_ptr<quant::ModelQuantizers> resume_quantization_aware_training(
    const TrainOptions& o, hf::CausalLM& model, const hf::Parallelism& parallelism,
    const std::filesystem::path& checkpoint) {
  const hf::SafetensorsFile file(checkpoint / kQatStateFile);
  auto quantizers = std::make_unique<quant::ModelQuantizers>(model, qat_config(o));
  const c10::Device device = compute_device();
  for (const auto& q : quantizers->linears()) {
    const std::string scale_key = q->name + ".input_quantizer._pre_quant_scale";
    if (file.contains(scale_key)) {
      q->input_quantizer->set_pre_quant_scale(file.tensor(scale_key).to(device));
    } else if (qat_config(o).algorithm == "awq_lite" && q->weight_quantizer->is_enabled()) {
      throw Error("mdist train: " + (checkpoint / kQatStateFile).string() + " has no " + scale_key);
    }
    for (auto* quantizer : {&q->input_quantizer, &q->weight_quantizer}) {
      if (!(*quantizer)->is_enabled()) continue;
      const bool weight = quantizer == &q->weight_quantizer;
      const std::string key =
          q->name + (weight ? ".weight_quantizer._amax" : ".input_quantizer._amax");
      if (!file.contains(key)) {
        // An input no calibration token reached has no amax (it quantizes with its input's
        // own max, as modelopt's); a weight always has one.
        if (weight)
          throw Error("mdist train: " + (checkpoint / kQatStateFile).string() + " has no " + key);
        continue;
      }
      at::Tensor amax = file.tensor(key);
      if (weight && parallelism.tensor_parallel_split() &&
          (*quantizer)->format().axis() == quant::Axis::per_row) {
        // quantize() keeps a column-parallel per-row weight amax per shard: this rank's rows.
        const auto placement = parallelism.tensor_parallel->placement(q->name + ".weight");
        if (placement.split == hf::TensorParallelPlacement::Split::kRows) {
          amax = placement.local_part(amax);
        }
      }
      (*quantizer)->set_amax(amax.to(device));
    }
  }
  // The KV cache's quantizers: their amax is whole (synced over tensor parallelism).
  for (const auto& a : quantizers->attentions()) {
    for (auto* quantizer : {&a->k_bmm_quantizer, &a->v_bmm_quantizer}) {
      if (!(*quantizer)->is_enabled()) continue;
      const std::string key =
          a->name +
          (quantizer == &a->k_bmm_quantizer ? ".k_bmm_quantizer._amax" : ".v_bmm_quantizer._amax");
      if (file.contains(key)) (*quantizer)->set_amax(file.tensor(key).to(device));
    }
  }
  return quantizers;
}

std::string describe_qat(const TrainOptions& o) {
  if (o.quant.empty()) return "none";
  return o.quant + " (backward " + o.quant_backward + ", " +
         (o.kv_cache.empty() ? std::string() : "kv-cache " + o.kv_cache + ", ") +
         std::to_string(o.calib_sequences) + " calibration sequences of " +
         (o.calib_data ? o.calib_data->string() : std::string("the training data")) + ")";
}

}  // namespace mdist::cli
