// quant::export_hf_checkpoint: modelopt 0.47's unified HF checkpoint for FP8 and INT8.
#include "mdist/quant/export.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <nlohmann/json.hpp>

#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mdist/error.h"
#include "mdist/fsdp/fully_shard.h"
#include "mdist/fsdp/state_dict.h"
#include "mdist/hf/safetensors.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/io/atomic_file.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"

namespace mdist::quant {
namespace {

using json = nlohmann::ordered_json;

// modelopt's per-layer formats that this export writes (`get_quantization_format`).
enum class LayerFormat { none, fp8, int8_sq };

const char* quant_algo(LayerFormat format) {
  return format == LayerFormat::fp8 ? "FP8" : "W8A8_SQ_PER_CHANNEL";
}

LayerFormat layer_format(const QuantizedLinear& q) {
  const bool weight = q.weight_quantizer->is_enabled();
  const bool input = q.input_quantizer->is_enabled();
  if (!weight && !input) return LayerFormat::none;
  const QuantFormat& w = q.weight_quantizer->format();
  const QuantFormat& x = q.input_quantizer->format();
  if (weight && input && w == QuantFormat::fp8() && x == QuantFormat::fp8()) {
    return LayerFormat::fp8;
  }
  if (weight && input && w == QuantFormat::int8_per_row() && x == QuantFormat::int8()) {
    return LayerFormat::int8_sq;
  }
  throw Error("mdist::quant: export_hf_checkpoint: " + q.name + " is quantized as weight " +
              (weight ? w.str() : "disabled") + ", input " + (input ? x.str() : "disabled") +
              "; only the fp8 and int8 presets' layers can be exported yet");
}

// modelopt's TensorQuantizer.export_amax then `amax.float() / maxbound`
// (quant_utils.get_scaling_factor): a zero or NaN amax becomes maxbound, then clamped to
// [tiny, max] of the amax's dtype.
at::Tensor scaling_factor(const at::Tensor& amax, double maxbound) {
  at::Tensor sanitized =
      at::nan_to_num(at::where(amax == 0, at::full_like(amax, maxbound), amax), maxbound);
  // torch.finfo(amax.dtype).tiny and .max.
  double tiny = std::numeric_limits<float>::min(), top = std::numeric_limits<float>::max();
  if (amax.scalar_type() == at::kBFloat16) {
    tiny = static_cast<float>(std::numeric_limits<c10::BFloat16>::min());
    top = static_cast<float>(std::numeric_limits<c10::BFloat16>::max());
  } else if (amax.scalar_type() == at::kHalf) {
    tiny = static_cast<float>(std::numeric_limits<c10::Half>::min());
    top = static_cast<float>(std::numeric_limits<c10::Half>::max());
  }
  sanitized = sanitized.clamp(tiny, top);
  return sanitized.to(at::kFloat) / maxbound;
}

// The exported tensors of one quantized Linear (modelopt's `_export_quantized_weight` and
// `to_quantized_weight`), scales squeezed as `postprocess_state_dict` leaves them.
// `weight_amax`: the whole layer's (under tensor parallelism, a column-parallel per-row amax
// gathered from the ranks).
void export_linear(const QuantizedLinear& q, LayerFormat format, const at::Tensor& weight_amax,
                   std::map<std::string, at::Tensor>& tensors) {
  const at::Tensor weight = tensors.at(q.name + ".weight");
  const at::Tensor input_scale =
      scaling_factor(q.input_quantizer->amax(), q.input_quantizer->format().maxbound());
  at::Tensor weight_scale;
  if (format == LayerFormat::fp8) {
    // modelopt's FP8 branch of `_export_quantized_weight`: amax to fp32, a 0-d scale
    // amax / 448 (no sanitising), and W / scale in the weights' dtype (a 0-d tensor does not
    // promote: bf16 weights are divided in bf16).
    weight_scale = weight_amax.to(at::kFloat).reshape({}) / 448.0;
    tensors[q.name + ".weight"] = (weight / weight_scale).to(at::kFloat8_e4m3fn);
  } else {
    // `to_quantized_weight` with the [out] fp32 scale of get_weight_scaling_factor: the
    // [out, 1] divisor promotes bf16 weights to fp32.
    weight_scale =
        scaling_factor(weight_amax, q.weight_quantizer->format().maxbound()).reshape({-1});
    tensors[q.name + ".weight"] =
        (weight / weight_scale.unsqueeze(1)).round().clamp(-128, 127).to(at::kChar);
  }
  tensors[q.name + ".weight_scale"] = weight_scale.squeeze();
  tensors[q.name + ".input_scale"] = input_scale.squeeze();
}

void check_dtypes(const std::map<std::string, at::Tensor>& tensors) {
  for (const auto& [name, tensor] : tensors) {
    if (tensor.scalar_type() != at::kFloat && tensor.scalar_type() != at::kBFloat16) {
      throw Error("mdist::quant: export_hf_checkpoint: " + name + " is " +
                  std::string(c10::toString(tensor.scalar_type())) +
                  "; only fp32 and bf16 models can be exported yet");
    }
  }
}

bool keeps_whole(const hf::Parallelism& parallelism) {
  const bool split = parallelism.tensor_parallel_split();
  return split ? parallelism.tensor_parallel->holds_global_rank0()
               : !mdist::is_initialized() || mdist::is_master();
}

// The whole parameters in the HF layout on rank 0, empty elsewhere. Collective where the
// layout needs it, as modelopt's full-state-dict gather: FSDP gathers over its groups, and
// under tensor parallelism the group holding rank 0 joins its parts (save_pretrained's path).
std::map<std::string, at::Tensor> whole_parameters(hf::CausalLM& model,
                                                   const hf::Parallelism& parallelism) {
  const bool keep = keeps_whole(parallelism);
  std::map<std::string, at::Tensor> local;
  if (is_fsdp2_model(*model)) {
    local = full_state_dict(*model, {.cpu = true, .keep = keep});
  } else if (keep) {
    for (const auto& item : model->named_parameters()) local[item.key()] = item.value().detach();
  }
  if (!parallelism.tensor_parallel_split() || !keep) return local;
  return parallelism.tensor_parallel->gather(local);
}

// The whole layer's weight amax. A column-parallel per-row amax holds this rank's rows only
// (quantize keeps it per shard, as modelopt): the tensor-parallel group's rows are joined at
// their offsets (ranks sharing replicated KV heads send the same rows). Collective over the
// tensor-parallel group for every such Linear, in module order.
at::Tensor whole_weight_amax(const QuantizedLinear& q, const hf::Parallelism& parallelism) {
  const TensorQuantizer& quantizer = q.weight_quantizer;
  if (!quantizer->has_amax()) {
    throw Error("mdist::quant: export_hf_checkpoint: " + q.name +
                ".weight_quantizer has no amax (it was never calibrated)");
  }
  const at::Tensor& amax = quantizer->amax();
  if (!parallelism.tensor_parallel_split() || quantizer->format().axis() != Axis::per_row) {
    return amax;
  }
  const auto placement = parallelism.tensor_parallel->placement(q.name + ".weight");
  if (placement.split != hf::TensorParallelPlacement::Split::kRows) return amax;
  const auto parts = allgather(std::make_pair(placement.offset, amax.detach().cpu()),
                               parallelism.tensor_parallel->group());
  at::Tensor whole = at::empty({placement.full_shape.front(), 1}, amax.options().device(at::kCPU));
  for (const auto& [offset, rows] : parts) whole.narrow(0, offset, rows.size(0)).copy_(rows);
  return whole;
}

json producer() { return {{"name", "modelopt"}, {"version", "0.47.0 (mdist)"}}; }

// config.json's quantization_config (modelopt's convert_hf_quant_config_format).
json quantization_config(LayerFormat format, const std::vector<std::string>& exclude) {
  json config = json::object();
  if (format == LayerFormat::fp8) {
    const json eight_bit_float = {{"dynamic", false}, {"num_bits", 8}, {"type", "float"}};
    config["config_groups"] = {{"group_0",
                                {{"input_activations", eight_bit_float},
                                 {"weights", eight_bit_float},
                                 {"targets", json::array({"Linear"})}}}};
  }
  config["ignore"] = exclude;
  config["quant_algo"] = quant_algo(format);
  config["producer"] = producer();
  config["quant_method"] = "modelopt";
  return config;
}

void write_files(hf::CausalLM& model, const std::map<std::string, at::Tensor>& tensors,
                 LayerFormat format, const std::vector<std::string>& exclude,
                 const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  hf::save_checkpoint(dir, tensors, std::uint64_t{5} << 30);
  const json hf_quant = {{"producer", producer()},
                         {"quantization",
                          {{"quant_algo", quant_algo(format)},
                           {"kv_cache_quant_algo", nullptr},
                           {"exclude_modules", exclude}}}};
  io::write_file_atomically(dir / "hf_quant_config.json", hf_quant.dump(4));
  json config = json::parse(model->config.to_json());
  config["quantization_config"] = quantization_config(format, exclude);
  io::write_file_atomically(dir / "config.json", config.dump(2) + "\n");
}

}  // namespace

void export_hf_checkpoint(hf::CausalLM& model, const ModelQuantizers& quantizers,
                          const std::filesystem::path& dir, const hf::Parallelism& parallelism) {
  if (parallelism.expert_parallel) {
    throw Error("mdist::quant: export_hf_checkpoint: expert-parallel models are not supported yet");
  }
  if (!parallelism.tensor_parallel_split() && hf::is_tensor_parallel_split(model)) {
    throw Error(
        "mdist::quant: export_hf_checkpoint: the model is split by tensor parallelism; "
        "pass its hf::Parallelism");
  }
  // Every check runs on every rank alike (the same model, the same synced quantizers), before
  // any collective and any file.
  std::map<std::string, at::Tensor> local_parameters;
  for (const auto& item : model->named_parameters()) local_parameters[item.key()] = item.value();
  check_dtypes(local_parameters);
  // modelopt lists every module that carries quantizers and quantizes nothing, in module
  // order: the embedding (a QuantEmbedding there), the disabled Linears, a tied lm_head
  // (a Linear in transformers).
  std::vector<std::string> unquantized{"model.embed_tokens"}, quantized;
  std::optional<LayerFormat> format;
  for (const auto& q : quantizers.linears()) {
    const LayerFormat layer = layer_format(*q);
    if (layer == LayerFormat::none) {
      unquantized.push_back(q->name);
      continue;
    }
    if (format && *format != layer) {
      throw Error(
          "mdist::quant: export_hf_checkpoint: layers are quantized in several formats "
          "(modelopt's MIXED_PRECISION); not supported yet");
    }
    if (!q->input_quantizer->has_amax()) {
      throw Error("mdist::quant: export_hf_checkpoint: " + q->name +
                  ".input_quantizer has no amax (no calibration input reached it)");
    }
    format = layer;
    quantized.push_back(q->name);
  }
  if (!format) throw Error("mdist::quant: export_hf_checkpoint: no layer is quantized");
  if (!model->lm_head) unquantized.push_back("lm_head");

  const at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> tensors = whole_parameters(model, parallelism);
  std::map<std::string, at::Tensor> weight_amax;
  for (const auto& q : quantizers.linears()) {
    if (layer_format(*q) != LayerFormat::none) {
      weight_amax[q->name] = whole_weight_amax(*q, parallelism);
    }
  }
  if (mdist::is_initialized() && !mdist::is_master()) return;
  for (const auto& q : quantizers.linears()) {
    if (weight_amax.contains(q->name)) {
      export_linear(*q, *format, weight_amax.at(q->name), tensors);
    }
  }
  write_files(model, tensors, *format, summarize_exclude_modules(unquantized, quantized), dir);
}

std::map<std::string, at::Tensor> whole_amax_state_dict(const ModelQuantizers& quantizers,
                                                        const hf::Parallelism& parallelism) {
  std::map<std::string, at::Tensor> amax = quantizers.amax_state_dict();
  for (const auto& q : quantizers.linears()) {
    if (!q->weight_quantizer->has_amax()) continue;
    amax[q->name + ".weight_quantizer._amax"] = whole_weight_amax(*q, parallelism);
  }
  return amax;
}

}  // namespace mdist::quant
