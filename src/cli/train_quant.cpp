// See src/cli/train_quant.h.
#include "src/cli/train_quant.h"

#include <torch/torch.h>

#include <algorithm>

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

std::string describe_qat(const TrainOptions& o) {
  if (o.quant.empty()) return "none";
  return o.quant + " (backward " + o.quant_backward + ", " + std::to_string(o.calib_sequences) +
         " calibration sequences of " +
         (o.calib_data ? o.calib_data->string() : std::string("the training data")) + ")";
}

}  // namespace mdist::cli
