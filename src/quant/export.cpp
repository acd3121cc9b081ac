// quant::export_hf_checkpoint: modelopt 0.47's unified HF checkpoint for FP8, INT8, INT4 AWQ and
// NVFP4.
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
#include "src/quant/export_awq.h"
#include "src/quant/nvfp4_export.h"

namespace mdist::quant {
namespace detail {

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

}  // namespace detail
namespace {

using detail::scaling_factor;

using json = nlohmann::ordered_json;

// modelopt's per-layer formats that this export writes (`get_quantization_format`).
enum class LayerFormat { none, fp8, int8_sq, nvfp4, int4_awq, w4a8_awq };

const char* quant_algo(LayerFormat format) {
  if (format == LayerFormat::int4_awq) return "W4A16_AWQ";
  if (format == LayerFormat::w4a8_awq) return "W4A8_AWQ";
  if (format == LayerFormat::nvfp4) return "NVFP4";
  return format == LayerFormat::fp8 ? "FP8" : "W8A8_SQ_PER_CHANNEL";
}

LayerFormat layer_format(const QuantizedLinear& q) {
  const bool weight = q.weight_quantizer->is_enabled();
  const bool input = q.input_quantizer->is_enabled();
  if (!weight && !input) return LayerFormat::none;
  const QuantFormat& w = q.weight_quantizer->format();
  const QuantFormat& x = q.input_quantizer->format();
  // INT4_AWQ_CFG's weight-only layers (modelopt's int4_awq format: the AWQ pre_quant_scale).
  if (weight && !input && w == QuantFormat::int4_blocks() &&
      q.input_quantizer->pre_quant_scale().defined()) {
    return LayerFormat::int4_awq;
  }
  // W4A8_AWQ_BETA_CFG's: INT4 blocks then FP8 per tensor (a SequentialQuantizer), FP8 inputs.
  if (weight && input && w == QuantFormat::int4_blocks() && x == QuantFormat::fp8() &&
      q.weight_quantizer_2 && q.weight_quantizer_2->is_enabled() &&
      q.weight_quantizer_2->format() == QuantFormat::fp8() &&
      q.input_quantizer->pre_quant_scale().defined()) {
    return LayerFormat::w4a8_awq;
  }
  if (weight && input && w == QuantFormat::fp8() && x == QuantFormat::fp8()) {
    return LayerFormat::fp8;
  }
  if (weight && input && w == QuantFormat::int8_per_row() && x == QuantFormat::int8()) {
    return LayerFormat::int8_sq;
  }
  if (weight && input && w == QuantFormat::nvfp4() && x == QuantFormat::nvfp4()) {
    return LayerFormat::nvfp4;
  }
  throw Error(
      "mdist::quant: export_hf_checkpoint: " + q.name + " is quantized as weight " +
      (weight ? w.str() : "disabled") + ", input " + (input ? x.str() : "disabled") +
      "; only the fp8, int8, int4_awq, w4a8_awq and nvfp4 presets' layers can be exported yet");
}

// The exported tensors of one quantized Linear (modelopt's `_export_quantized_weight` and
// `to_quantized_weight`), scales squeezed as `postprocess_state_dict` leaves them.
// `weight_amax`: the whole layer's (under tensor parallelism, a column-parallel per-row amax
// gathered from the ranks).
void export_linear(const QuantizedLinear& q, LayerFormat format, const at::Tensor& weight_amax,
                   const at::Tensor& input_amax, std::map<std::string, at::Tensor>& tensors) {
  const at::Tensor weight = tensors.at(q.name + ".weight");
  if (format == LayerFormat::nvfp4) {
    detail::Nvfp4Weight packed = detail::nvfp4_export_weight(weight, weight_amax);
    tensors[q.name + ".weight"] = std::move(packed.packed);
    tensors[q.name + ".weight_scale"] = std::move(packed.weight_scale);
    tensors[q.name + ".weight_scale_2"] = std::move(packed.weight_scale_2);
    tensors[q.name + ".input_scale"] = detail::nvfp4_input_scale(input_amax);
    return;
  }
  const at::Tensor input_scale = scaling_factor(input_amax, q.input_quantizer->format().maxbound());
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

// A per-input-channel vector of `q` (SmoothQuant's scales) for the whole layer: a row-parallel
// Linear's shards hold their own input channels, joined here at their column offsets; the other
// layouts hold all channels. Collective over the tensor-parallel group for every row-parallel
// Linear, in module order.
at::Tensor whole_channels(const QuantizedLinear& q, const at::Tensor& local,
                          const hf::Parallelism& parallelism) {
  if (!parallelism.tensor_parallel_split()) return local;
  const auto placement = parallelism.tensor_parallel->placement(q.name + ".weight");
  if (placement.split != hf::TensorParallelPlacement::Split::kColumns) return local;
  const auto parts = allgather(std::make_pair(placement.offset, local.detach().cpu()),
                               parallelism.tensor_parallel->group());
  at::Tensor whole = at::empty({placement.full_shape.at(1)}, local.options().device(at::kCPU));
  for (const auto& [offset, values] : parts) whole.narrow(0, offset, values.size(0)).copy_(values);
  return whole;
}

// The per-row amax of a weight as modelopt's max calibration takes it (in the weight's dtype).
at::Tensor row_amax(const at::Tensor& weight) {
  return at::maximum(at::amax(weight, {1}, /*keepdim=*/true).abs(),
                     at::amin(weight, {1}, /*keepdim=*/true).abs());
}

// What one SmoothQuant layer exports, before and after modelopt's fused-layer preprocessing.
struct Smoothed {
  at::Tensor weight;           // the smoothed whole weight, in the model's dtype
  at::Tensor pre_quant_scale;  // s, in the model's dtype
  at::Tensor weight_amax;      // per row, from `weight`
  at::Tensor input_amax;
};

// The Linears that read one tensor (modelopt finds them with a dummy forward; in the Llama-like
// decoders mdist builds they are a parent's q/k/v and gate/up projections).
std::string fusion_group(const std::string& name) {
  const auto dot = name.rfind('.');
  const std::string parent = name.substr(0, dot), leaf = name.substr(dot + 1);
  if (leaf == "q_proj" || leaf == "k_proj" || leaf == "v_proj") return parent + ".qkv";
  if (leaf == "gate_proj" || leaf == "up_proj") return parent + ".gate_up";
  return name;
}

// modelopt's `requantize_resmooth_fused_llm_layers` / `preprocess_linear_fusion` for
// SmoothQuant layers sharing an input: the group's pre_quant_scale becomes their mean (in the
// model's dtype); a layer whose scale changes has its weight re-smoothed in fp32,
// W * old / new, cast back, and its per-row amax taken again; every layer of the group gets
// the group's largest input amax (which is not recomputed for the new scale, as modelopt's).
void fuse_shared_inputs(const std::vector<std::string>& order,
                        std::map<std::string, Smoothed>& layers) {
  std::map<std::string, std::vector<std::string>> groups;
  std::vector<std::string> group_order;
  for (const auto& name : order) {
    if (!layers.contains(name)) continue;
    const std::string group = fusion_group(name);
    if (!groups.contains(group)) group_order.push_back(group);
    groups[group].push_back(name);
  }
  for (const auto& group : group_order) {
    const auto& members = groups.at(group);
    if (members.size() < 2) continue;
    std::vector<at::Tensor> scales, input_amax;
    for (const auto& m : members) {
      scales.push_back(layers.at(m).pre_quant_scale);
      input_amax.push_back(layers.at(m).input_amax);
    }
    const at::Tensor mean = at::mean(at::stack(scales), 0);
    const at::Tensor largest = at::max(at::stack(input_amax));
    for (const auto& m : members) {
      Smoothed& layer = layers.at(m);
      if (!at::equal(layer.pre_quant_scale, mean)) {
        layer.weight = (layer.weight.to(at::kFloat) * layer.pre_quant_scale.to(at::kFloat) /
                        mean.to(at::kFloat))
                           .to(layer.weight.scalar_type());
        layer.pre_quant_scale = mean;
        layer.weight_amax = row_amax(layer.weight);
      }
      layer.input_amax = largest;
    }
  }
}

// modelopt's `preprocess_linear_fusion` for per-tensor amaxes (NVFP4's global amaxes): the
// layers reading one input (q/k/v, gate/up) get the group's largest input amax and the group's
// largest weight amax, so that they share input_scale and weight_scale_2 (the block scales
// are then taken under that weight_scale_2).
void share_fused_amax(const std::vector<std::string>& order,
                      std::map<std::string, at::Tensor>& weight_amax,
                      std::map<std::string, at::Tensor>& input_amax) {
  std::map<std::string, std::vector<std::string>> groups;
  for (const auto& name : order) groups[fusion_group(name)].push_back(name);
  for (const auto& [group, members] : groups) {
    if (members.size() < 2) continue;
    std::vector<at::Tensor> weights, inputs;
    for (const auto& m : members) {
      weights.push_back(weight_amax.at(m).cpu());
      inputs.push_back(input_amax.at(m).cpu());
    }
    const at::Tensor weight = at::max(at::stack(weights)), input = at::max(at::stack(inputs));
    for (const auto& m : members) {
      weight_amax[m] = weight;
      input_amax[m] = input;
    }
  }
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
json quantization_config(LayerFormat format, const std::vector<std::string>& exclude,
                         const std::optional<std::string>& kv_cache) {
  json config = json::object();
  if (format == LayerFormat::fp8 || format == LayerFormat::nvfp4) {
    const json scheme =
        format == LayerFormat::fp8
            ? json{{"dynamic", false}, {"num_bits", 8}, {"type", "float"}}
            : json{{"dynamic", false}, {"num_bits", 4}, {"type", "float"}, {"group_size", 16}};
    config["config_groups"] = {{"group_0",
                                {{"input_activations", scheme},
                                 {"weights", scheme},
                                 {"targets", json::array({"Linear"})}}}};
  }
  config["ignore"] = exclude;
  config["quant_algo"] = quant_algo(format);
  if (kv_cache)
    config["kv_cache_scheme"] = {{"dynamic", false}, {"num_bits", 8}, {"type", "float"}};
  config["producer"] = producer();
  config["quant_method"] = "modelopt";
  return config;
}

void write_files(hf::CausalLM& model, const std::map<std::string, at::Tensor>& tensors,
                 LayerFormat format, const std::vector<std::string>& exclude,
                 const std::optional<std::string>& kv_cache, const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  hf::save_checkpoint(dir, tensors, std::uint64_t{5} << 30);
  json quantization = {{"quant_algo", quant_algo(format)},
                       {"kv_cache_quant_algo", kv_cache ? json(*kv_cache) : json(nullptr)}};
  if (format == LayerFormat::nvfp4) quantization["group_size"] = 16;
  // modelopt's process_layer_quant_config for AWQ (int4_awq and w4a8_awq alike).
  if (format == LayerFormat::int4_awq || format == LayerFormat::w4a8_awq) {
    quantization["group_size"] = QuantFormat::int4_blocks().block_size();
    quantization["has_zero_point"] = false;
    quantization["pre_quant_scale"] = true;
  }
  quantization["exclude_modules"] = exclude;
  const json hf_quant = {{"producer", producer()}, {"quantization", quantization}};
  io::write_file_atomically(dir / "hf_quant_config.json", hf_quant.dump(4));
  json config = json::parse(model->config.to_json());
  config["quantization_config"] = quantization_config(format, exclude, kv_cache);
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
    if (layer != LayerFormat::int4_awq && !q->input_quantizer->has_amax()) {
      throw Error("mdist::quant: export_hf_checkpoint: " + q->name +
                  ".input_quantizer has no amax (no calibration input reached it)");
    }
    format = layer;
    quantized.push_back(q->name);
  }
  if (!format) throw Error("mdist::quant: export_hf_checkpoint: no layer is quantized");
  if (!model->lm_head) unquantized.push_back("lm_head");
  const std::optional<std::string> kv_cache = detail::kv_cache_quant_algo(quantizers.attentions());

  const at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> tensors = whole_parameters(model, parallelism);
  std::map<std::string, at::Tensor> weight_amax, input_amax;
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> smoothing;  // 1 / s, s
  std::vector<std::string> order;
  std::vector<detail::AwqLayer> awq;
  for (const auto& q : quantizers.linears()) {
    if (layer_format(*q) == LayerFormat::none) continue;
    order.push_back(q->name);
    weight_amax[q->name] = whole_weight_amax(*q, parallelism);
    input_amax[q->name] = q->input_quantizer->amax();
    if (layer_format(*q) == LayerFormat::int4_awq || layer_format(*q) == LayerFormat::w4a8_awq) {
      awq.push_back(
          {q->name,
           q->smoothing.defined() ? whole_channels(*q, q->smoothing, parallelism) : at::Tensor(),
           whole_channels(*q, q->input_quantizer->pre_quant_scale(), parallelism),
           layer_format(*q) == LayerFormat::w4a8_awq ? q->input_quantizer->amax().cpu()
                                                     : at::Tensor()});
    } else if (q->smoothing.defined()) {
      smoothing[q->name] = {whole_channels(*q, q->smoothing, parallelism),
                            whole_channels(*q, q->input_quantizer->pre_quant_scale(), parallelism)};
    }
  }
  if (mdist::is_initialized() && !mdist::is_master()) return;
  if (*format == LayerFormat::int4_awq || *format == LayerFormat::w4a8_awq) {
    detail::export_int4_awq(awq, QuantFormat::int4_blocks().block_size(),
                            *format == LayerFormat::w4a8_awq, tensors);
    for (auto& [name, scale] : detail::kv_cache_scales(quantizers.attentions())) {
      tensors[name] = std::move(scale);
    }
    write_files(model, tensors, *format, summarize_exclude_modules(unquantized, quantized),
                kv_cache, dir);
    return;
  }
  // SmoothQuant: the smoothed weights (the model keeps its own), then modelopt's fused-layer
  // preprocessing, which only changes layers with a pre_quant_scale.
  std::map<std::string, Smoothed> smoothed;
  for (const auto& [name, scales] : smoothing) {
    const at::Tensor weight = smoothed_weight(tensors.at(name + ".weight"), scales.first.cpu());
    smoothed[name] = {weight, scales.second.cpu(), row_amax(weight), input_amax.at(name).cpu()};
  }
  fuse_shared_inputs(order, smoothed);
  if (*format == LayerFormat::nvfp4) share_fused_amax(order, weight_amax, input_amax);
  for (const auto& [name, layer] : smoothed) {
    tensors[name + ".weight"] = layer.weight;
    tensors[name + ".pre_quant_scale"] = layer.pre_quant_scale;
    weight_amax[name] = layer.weight_amax;
    input_amax[name] = layer.input_amax;
  }
  for (const auto& q : quantizers.linears()) {
    if (weight_amax.contains(q->name)) {
      export_linear(*q, *format, weight_amax.at(q->name), input_amax.at(q->name), tensors);
    }
  }
  for (auto& [name, scale] : detail::kv_cache_scales(quantizers.attentions())) {
    tensors[name] = std::move(scale);
  }
  write_files(model, tensors, *format, summarize_exclude_modules(unquantized, quantized), kv_cache,
              dir);
}

std::map<std::string, at::Tensor> whole_amax_state_dict(const ModelQuantizers& quantizers,
                                                        const hf::Parallelism& parallelism) {
  std::map<std::string, at::Tensor> amax = quantizers.amax_state_dict();
  for (const auto& q : quantizers.linears()) {
    if (!q->weight_quantizer->has_amax()) continue;
    const std::string stage = q->weight_quantizer_2 ? ".weight_quantizer.0" : ".weight_quantizer";
    amax[q->name + stage + "._amax"] = whole_weight_amax(*q, parallelism);
  }
  return amax;
}

}  // namespace mdist::quant
