// KV-cache quantizers (modelopt 0.47's FP8_KV_CFG): see include/mdist/quant/kv_cache.h.
#include "mdist/quant/kv_cache.h"

#include <ATen/ATen.h>

#include <utility>

#include "mdist/error.h"

namespace mdist::quant {
namespace {

// modelopt registers transformers' attentions on the fly (register_hf_attentions_on_the_fly)
// under their own class; no preset restricts a rule to it.
constexpr const char* kAttentionClass = "Attention";
// modelopt's export divides every KV amax by this (unified_export_hf: kv_cache_max_bound).
constexpr double kKvCacheMaxBound = 448.0;

TensorQuantizer make_quantizer(const ResolvedQuantizer& resolved) {
  TensorQuantizer quantizer(resolved.format);
  quantizer->set_mode(resolved.enabled ? TensorQuantizerImpl::Mode::quantize
                                       : TensorQuantizerImpl::Mode::disabled);
  return quantizer;
}

}  // namespace

std::vector<std::string> kv_cache_format_names() { return {"fp8"}; }

void add_kv_cache_rules(QuantConfig& config, std::string_view name) {
  if (name != "fp8") {
    throw InputError("mdist::quant: unknown KV-cache format '" + std::string(name) +
                     "'; the KV-cache formats are: fp8 (modelopt's FP8_KV_CFG)");
  }
  config.rules.push_back(
      QuantRule{"*[kv]_bmm_quantizer", QuantFormat::fp8(), true, std::nullopt, std::nullopt});
  config.name += "+kv_fp8";
}

namespace detail {

std::vector<std::unique_ptr<QuantizedAttention>> make_quantized_attentions(
    hf::CausalLM& model, const QuantConfig& config) {
  std::vector<std::unique_ptr<QuantizedAttention>> attentions;
  for (const auto& item : model->named_modules("", /*include_self=*/false)) {
    auto attention = std::dynamic_pointer_cast<hf::AttentionImpl>(item.value());
    if (!attention) continue;
    auto q = std::make_unique<QuantizedAttention>();
    q->name = item.key();
    q->attention = std::move(attention);
    // An unmatched quantizer keeps modelopt's TensorQuantizer() default: INT8 per tensor.
    q->k_bmm_quantizer = make_quantizer(
        config.resolve(q->name + ".k_bmm_quantizer", kAttentionClass, QuantizerRole::input));
    q->v_bmm_quantizer = make_quantizer(
        config.resolve(q->name + ".v_bmm_quantizer", kAttentionClass, QuantizerRole::input));
    if (q->enabled() && q->attention->qkv_proj) {
      throw InputError("mdist::quant: " + q->name +
                       " has one fused qkv_proj (Phi-3): KV-cache quantization is not supported "
                       "there (the unified checkpoint names k_scale / v_scale after k_proj / "
                       "v_proj, which this attention does not have)");
    }
    attentions.push_back(std::move(q));
  }
  return attentions;
}

std::optional<std::string> kv_cache_quant_algo(
    const std::vector<std::unique_ptr<QuantizedAttention>>& attentions) {
  std::size_t enabled = 0, quantizers = 0;
  for (const auto& a : attentions) {
    for (const TensorQuantizer* q : {&a->k_bmm_quantizer, &a->v_bmm_quantizer}) {
      ++quantizers;
      if (!(*q)->is_enabled()) continue;
      ++enabled;
      if ((*q)->format() != QuantFormat::fp8()) {
        throw Error("mdist::quant: export_hf_checkpoint: " + a->name +
                    "'s KV-cache quantizers are " + (*q)->format().str() +
                    "; only FP8 (E4M3 per tensor) can be exported");
      }
      if (!(*q)->has_amax()) {
        throw Error("mdist::quant: export_hf_checkpoint: " + a->name +
                    "'s KV-cache quantizers have no amax (never calibrated)");
      }
    }
  }
  if (enabled == 0) return std::nullopt;
  if (enabled != quantizers) {
    throw Error(
        "mdist::quant: export_hf_checkpoint: the KV cache is quantized in some attentions only "
        "(or keys without values); not supported");
  }
  return "FP8";
}

std::map<std::string, at::Tensor> kv_cache_scales(
    const std::vector<std::unique_ptr<QuantizedAttention>>& attentions) {
  std::map<std::string, at::Tensor> scales;
  for (const auto& a : attentions) {
    if (!a->enabled()) continue;
    // postprocess_state_dict: `value.float() / kv_cache_max_bound`, the amax's shape ([]).
    scales[a->name + ".k_proj.k_scale"] =
        a->k_bmm_quantizer->amax().detach().to(at::kCPU, at::kFloat).reshape({}) / kKvCacheMaxBound;
    scales[a->name + ".v_proj.v_scale"] =
        a->v_bmm_quantizer->amax().detach().to(at::kCPU, at::kFloat).reshape({}) / kKvCacheMaxBound;
  }
  return scales;
}

}  // namespace detail
}  // namespace mdist::quant
