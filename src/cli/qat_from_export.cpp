// See src/cli/qat_from_export.h.
#include "src/cli/qat_from_export.h"

#include <torch/torch.h>

#include "mdist/error.h"
#include "mdist/hf/safetensors.h"
#include "mdist/runtime/device.h"
#include "src/cli/input_error.h"
#include "src/cli/train_quant.h"

namespace mdist::cli {

namespace {

// The quant_algo an export of --quant `format` carries (modelopt's names).
std::string quant_algo_of(const std::string& format) {
  return format == "fp8" ? "FP8" : format == "int8" ? "W8A8_SQ_PER_CHANNEL" : format;
}

bool has_pre_quant_scale(const std::filesystem::path& dir) {
  const hf::SafetensorsCheckpoint checkpoint(dir);
  for (const auto& name : checkpoint.names()) {
    if (name.ends_with(".pre_quant_scale")) return true;
  }
  return false;
}

}  // namespace

void check_qat_start_model(const TrainOptions& o, const ModelChoice& model) {
  if (!model.quantization) return;
  if (o.quant.empty()) {
    check_not_quantized(model, "train");  // throws: plain training needs the weights
  }
  const std::string where = "--model '" + model.dir->string() + "'";
  if (o.quant != "fp8" && o.quant != "int8") {
    throw InputError(where +
                     " is a quantized export; continuing quantization-aware training "
                     "from an export supports --quant fp8 and int8 only (not " +
                     o.quant + ")");
  }
  const hf::CheckpointQuantization& q = *model.quantization;
  if (q.quant_algo != quant_algo_of(o.quant)) {
    throw InputError(where + " is quantized with quant_algo " + q.quant_algo + " (" + q.source +
                     "), which --quant " + o.quant + " does not continue (it exports " +
                     quant_algo_of(o.quant) + ")");
  }
  if (q.kv_cache_quant_algo) {
    throw InputError(where + " has a quantized KV cache (kv_cache_quant_algo " +
                     *q.kv_cache_quant_algo +
                     "); quantization-aware training continues weights and inputs only");
  }
  if (!o.kv_cache.empty()) {
    // The export has no k/v scales to take, and no calibration runs here to make them.
    throw InputError("--kv-cache " + o.kv_cache + " does not apply to " + where +
                     ": continuing an export quantizes weights and inputs only");
  }
  if (has_pre_quant_scale(*model.dir)) {
    throw InputError(where +
                     " holds SmoothQuant's pre_quant_scale (an int8_sq export); --quant int8 "
                     "continues an unsmoothed INT8_DEFAULT_CFG export only");
  }
  const char* calibration = o.calib_data              ? "--calib-data"
                            : o.calib_sequences_given ? "--calib-sequences"
                                                      : nullptr;
  if (calibration != nullptr) {
    throw InputError(std::string(calibration) + " does not apply to " + where +
                     ": a quantized export's scales are its calibration (no calibration runs)");
  }
}

std::unique_ptr<quant::ModelQuantizers> start_qat_from_export(const TrainOptions& o,
                                                              hf::CausalLM& model,
                                                              const hf::Parallelism& parallelism,
                                                              const std::filesystem::path& dir) {
  const hf::SafetensorsCheckpoint checkpoint(dir);
  auto quantizers = std::make_unique<quant::ModelQuantizers>(model, qat_config(o));
  const c10::Device device = compute_device();
  for (const auto& q : quantizers->linears()) {
    for (auto* quantizer : {&q->input_quantizer, &q->weight_quantizer}) {
      if (!(*quantizer)->is_enabled()) continue;
      const bool weight = quantizer == &q->weight_quantizer;
      const std::string key = q->name + (weight ? ".weight_scale" : ".input_scale");
      if (!checkpoint.contains(key)) {
        throw Error("mdist train: the export '" + dir.string() + "' has no " + key +
                    ", which --quant " + o.quant + " quantizes");
      }
      // scale = amax / maxbound in fp32 (the export's division): its inverse, in fp32.
      at::Tensor amax = checkpoint.tensor(key).to(at::kFloat) *
                        static_cast<float>((*quantizer)->format().maxbound());
      if (weight && (*quantizer)->format().axis() == quant::Axis::per_row) {
        amax = amax.reshape({-1, 1});  // one per output row, as calibration keeps it
        if (parallelism.tensor_parallel_split()) {
          const auto placement = parallelism.tensor_parallel->placement(q->name + ".weight");
          if (placement.split == hf::TensorParallelPlacement::Split::kRows) {
            amax = amax.narrow(0, placement.offset, placement.length);
          }
        }
      } else {
        amax = amax.reshape({});
      }
      (*quantizer)->set_amax(amax.contiguous().to(device));
    }
  }
  return quantizers;
}

}  // namespace mdist::cli
