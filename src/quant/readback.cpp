// quant::apply_checkpoint_quantization: see include/mdist/quant/readback.h.
#include "mdist/quant/readback.h"

#include <ATen/ATen.h>

#include <string>
#include <utility>

#include "mdist/error.h"
#include "mdist/hf/quantized_checkpoint.h"
#include "mdist/hf/safetensors.h"

namespace mdist::quant {

std::unique_ptr<ModelQuantizers> apply_checkpoint_quantization(hf::CausalLM& model,
                                                               const std::filesystem::path& dir,
                                                               const hf::Parallelism& parallelism) {
  const auto quantization = hf::checkpoint_quantization(dir);
  if (!quantization) return nullptr;
  if (!hf::is_readable(*quantization)) {
    throw Error("mdist::quant: checkpoint '" + dir.string() + "' is quantized with quant_algo " +
                quantization->quant_algo + "; reading back is implemented for " +
                hf::kReadableQuantAlgos + " with no KV-cache quantization or an FP8 one only");
  }
  // The preset whose input format the checkpoint's quant_algo names: only the input
  // quantizers are used, and only where the checkpoint has an input_scale.
  const std::string& algo = quantization->quant_algo;
  QuantConfig config = QuantConfig::preset(algo == "FP8" || algo == "W4A8_AWQ" ? "fp8"
                                           : algo == "NVFP4"                   ? "nvfp4"
                                                                               : "int8");
  if (quantization->kv_cache_quant_algo) add_kv_cache_rules(config, "fp8");
  auto quantizers = std::make_unique<ModelQuantizers>(model, config);
  const hf::SafetensorsCheckpoint checkpoint(dir);
  const c10::Device device = model->parameters().front().device();
  for (const auto& q : quantizers->linears()) {
    q->weight_quantizer->set_mode(TensorQuantizerImpl::Mode::disabled);
    TensorQuantizer& input = q->input_quantizer;
    input->set_mode(TensorQuantizerImpl::Mode::disabled);
    // SmoothQuant (INT8_SMOOTHQUANT_CFG's export) and AWQ (W4A16_AWQ, W4A8_AWQ: o_proj and
    // down_proj, the others folded into the norms): the input is multiplied by the pre_quant_scale
    // first, as the smoothed or folded weights stored here expect, also where the input itself is
    // not quantized (a disabled quantizer still applies it).
    const std::string smoothing = q->name + ".pre_quant_scale";
    if (checkpoint.contains(smoothing) &&
        hf::detail::is_quantization_scale(checkpoint, smoothing)) {
      at::Tensor pre_quant_scale = checkpoint.tensor(smoothing);
      // A row-parallel Linear holds columns [offset, offset + length) of the whole weight: its
      // input is those channels, scaled by that part of the pre_quant_scale.
      hf::TensorParallelPlacement placement;
      if (parallelism.tensor_parallel_split()) {
        placement = parallelism.tensor_parallel->placement(q->name + ".weight");
      }
      const bool columns = placement.split == hf::TensorParallelPlacement::Split::kColumns;
      const int64_t in_features = columns ? placement.full_shape.back() : q->linear->weight.size(1);
      if (pre_quant_scale.dim() != 1 || pre_quant_scale.size(0) != in_features) {
        throw Error("mdist::quant: checkpoint '" + dir.string() + "': " + smoothing +
                    " has shape " + c10::str(pre_quant_scale.sizes()) +
                    "; one value per input channel (" + std::to_string(in_features) +
                    ") is read back");
      }
      if (columns) pre_quant_scale = pre_quant_scale.narrow(0, placement.offset, placement.length);
      input->set_pre_quant_scale(pre_quant_scale.contiguous().to(device));
    }
    const std::string key = q->name + ".input_scale";
    if (!checkpoint.contains(key) || !hf::detail::is_quantization_scale(checkpoint, key)) continue;
    const at::Tensor scale = checkpoint.tensor(key).to(at::kFloat);
    if (scale.numel() != 1) {
      throw Error("mdist::quant: checkpoint '" + dir.string() + "': " + key + " has " +
                  std::to_string(scale.numel()) + " values; one per tensor is read back");
    }
    // fp32, on the device the model computes on (the fake quant meets its inputs there).
    // input_scale = amax / maxbound; NVFP4's is the global scale amax / (6 * 448) under which
    // the E4M3 block scales are computed at run time.
    const double unit = input->format().is_nvfp4() ? input->format().maxbound() * 448.0
                                                   : input->format().maxbound();
    input->set_amax((scale.reshape({}) * unit).to(device));
    input->set_mode(TensorQuantizerImpl::Mode::quantize);
  }
  // FP8 KV cache: keys and values fake-quantized with amax = k_scale / v_scale x 448 (fp32),
  // frozen, as the export's amax / 448 describes them.
  for (const auto& a : quantizers->attentions()) {
    if (!a->enabled()) continue;
    for (auto [quantizer, key] : {std::pair{a->k_bmm_quantizer, a->name + ".k_proj.k_scale"},
                                  std::pair{a->v_bmm_quantizer, a->name + ".v_proj.v_scale"}}) {
      if (!checkpoint.contains(key)) {
        throw Error("mdist::quant: checkpoint '" + dir.string() + "' has kv_cache_quant_algo " +
                    *quantization->kv_cache_quant_algo + " but no " + key);
      }
      const at::Tensor scale = checkpoint.tensor(key).to(at::kFloat);
      if (scale.numel() != 1) {
        throw Error("mdist::quant: checkpoint '" + dir.string() + "': " + key + " has " +
                    std::to_string(scale.numel()) + " values; one per tensor is read back");
      }
      quantizer->set_amax((scale.reshape({}) * quantizer->format().maxbound()).to(device));
      quantizer->set_mode(TensorQuantizerImpl::Mode::quantize);
    }
  }
  return quantizers;
}

}  // namespace mdist::quant
