// See src/cli/train_quant.h.
#include "src/cli/train_quant.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>

#include "mdist/error.h"
#include "mdist/hf/safetensors.h"
#include "mdist/quant/export.h"
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
  return config;
}

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
      m->forward(
          batch_of(calibration.windows, {real ? plan.windows[static_cast<std::size_t>(round)] : 0})
              .to(device));
    }
  };
  return quant::quantize(model, qat_config(o), loop,
                         {.parallel = layout.parallel, .parallelism = parallelism});
}

void save_qat_state(const quant::ModelQuantizers& quantizers, const hf::Parallelism& parallelism,
                    const TrainOptions& o, const std::filesystem::path& path) {
  const auto amax = quant::whole_amax_state_dict(quantizers, parallelism);
  if (rank() != 0) return;
  std::map<std::string, at::Tensor> tensors;
  for (const auto& [name, value] : amax) tensors.emplace(name, value.detach().cpu().contiguous());
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
  return quantizers;
}

std::string describe_qat(const TrainOptions& o) {
  if (o.quant.empty()) return "none";
  return o.quant + " (backward " + o.quant_backward + ", " + std::to_string(o.calib_sequences) +
         " calibration sequences of " +
         (o.calib_data ? o.calib_data->string() : std::string("the training data")) + ")";
}

}  // namespace mdist::cli
