// quant::apply_checkpoint_quantization: see include/mdist/quant/readback.h.
#include "mdist/quant/readback.h"

#include <ATen/ATen.h>

#include <string>

#include "mdist/error.h"
#include "mdist/hf/quantized_checkpoint.h"
#include "mdist/hf/safetensors.h"

namespace mdist::quant {

std::unique_ptr<ModelQuantizers> apply_checkpoint_quantization(hf::CausalLM& model,
                                                               const std::filesystem::path& dir) {
  const auto quantization = hf::checkpoint_quantization(dir);
  if (!quantization) return nullptr;
  if (!hf::is_readable(*quantization)) {
    throw Error("mdist::quant: checkpoint '" + dir.string() + "' is quantized with quant_algo " +
                quantization->quant_algo + "; reading back is implemented for " +
                hf::kReadableQuantAlgos + " without a KV-cache quantization only");
  }
  // The preset whose input format the checkpoint's quant_algo names: only the input
  // quantizers are used, and only where the checkpoint has an input_scale.
  const QuantConfig config =
      QuantConfig::preset(quantization->quant_algo == "FP8" ? "fp8" : "int8");
  auto quantizers = std::make_unique<ModelQuantizers>(model, config);
  const hf::SafetensorsCheckpoint checkpoint(dir);
  const c10::Device device = model->parameters().front().device();
  for (const auto& q : quantizers->linears()) {
    q->weight_quantizer->set_mode(TensorQuantizerImpl::Mode::disabled);
    TensorQuantizer& input = q->input_quantizer;
    input->set_mode(TensorQuantizerImpl::Mode::disabled);
    // SmoothQuant (INT8_SMOOTHQUANT_CFG's export) and AWQ (W4A16_AWQ: o_proj and down_proj,
    // the others folded into the norms): the input is multiplied by the pre_quant_scale first,
    // as the smoothed or folded weights stored here expect, also where the input itself is not
    // quantized (a disabled quantizer still applies it).
    const std::string smoothing = q->name + ".pre_quant_scale";
    if (checkpoint.contains(smoothing) &&
        hf::detail::is_quantization_scale(checkpoint, smoothing)) {
      const at::Tensor pre_quant_scale = checkpoint.tensor(smoothing);
      if (pre_quant_scale.dim() != 1 || pre_quant_scale.size(0) != q->linear->weight.size(1)) {
        throw Error("mdist::quant: checkpoint '" + dir.string() + "': " + smoothing +
                    " has shape " + c10::str(pre_quant_scale.sizes()) +
                    "; one value per input channel (" + std::to_string(q->linear->weight.size(1)) +
                    ") is read back");
      }
      input->set_pre_quant_scale(pre_quant_scale.to(device));
    }
    const std::string key = q->name + ".input_scale";
    if (!checkpoint.contains(key) || !hf::detail::is_quantization_scale(checkpoint, key)) continue;
    const at::Tensor scale = checkpoint.tensor(key).to(at::kFloat);
    if (scale.numel() != 1) {
      throw Error("mdist::quant: checkpoint '" + dir.string() + "': " + key + " has " +
                  std::to_string(scale.numel()) + " values; one per tensor is read back");
    }
    // fp32, on the device the model computes on (the fake quant meets its inputs there).
    input->set_amax((scale.reshape({}) * input->format().maxbound()).to(device));
    input->set_mode(TensorQuantizerImpl::Mode::quantize);
  }
  return quantizers;
}

}  // namespace mdist::quant
