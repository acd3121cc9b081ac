#pragma once
// KV-cache quantization as modelopt 0.47's FP8_KV_CFG (`--kv-cache fp8`): per attention, a
// k_bmm_quantizer and a v_bmm_quantizer (E4M3, per tensor) on the keys and values the
// attention reads, after RoPE and Qwen3's / OLMo 2's k norm, before the grouped-query repeat
// (modelopt's `_QuantAttention._quantized_attention`, which quantizes the arguments of
// transformers' attention interface). mdist hooks hf::AttentionImpl's k_bmm / v_bmm points.
//
//   QuantConfig config = QuantConfig::preset("fp8");
//   add_kv_cache_rules(config, "fp8");            // hf_ptq's update_quant_cfg_with_kv_cache_quant
//   auto quantizers = quantize(model, config, loop, options);   // k/v amax calibrated by max
//   quantizers->attentions();                       // the k/v quantizers per attention
//
// Calibration is max, synced (MAX) over the data-parallel group and, where tensor parallelism
// splits the heads, over the tensor-parallel group. The export writes
// `<attention>.k_proj.k_scale` / `.v_proj.v_scale` = amax (fp32) / 448 as 0-d fp32 tensors and
// `kv_cache_quant_algo: "FP8"` (hf_quant_config.json) / `kv_cache_scheme` (config.json), as
// modelopt's `postprocess_state_dict` and `convert_hf_quant_config_format` do.
//
// Phi-3's attention (one fused qkv_proj) is refused: the unified format names the scales after
// the k_proj / v_proj modules, which that attention does not have.
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mdist/hf/causal_lm.h"
#include "mdist/quant/quant_config.h"
#include "mdist/quant/tensor_quantizer.h"

namespace mdist::quant {

// The --kv-cache values implemented (modelopt's FP8_KV_CFG).
std::vector<std::string> kv_cache_format_names();

// Appends the rules of the KV-cache format `name` ("fp8": modelopt's FP8_KV_CFG,
// `*[kv]_bmm_quantizer` E4M3 per tensor) to `config`, after its own (later rules win), as
// modelopt's `update_quant_cfg_with_kv_cache_quant`. Throws InputError for an unknown name.
void add_kv_cache_rules(QuantConfig& config, std::string_view name);

// One attention's KV-cache quantizers (a disabled quantizer is present, in mode disabled).
struct QuantizedAttention {
  std::string name;  // "model.layers.0.self_attn"
  std::shared_ptr<hf::AttentionImpl> attention;
  TensorQuantizer k_bmm_quantizer{nullptr};
  TensorQuantizer v_bmm_quantizer{nullptr};
  bool enabled() const { return k_bmm_quantizer->is_enabled() || v_bmm_quantizer->is_enabled(); }
};

namespace detail {

// Every attention of `model` with its k/v quantizers as `config` resolves them. Throws
// InputError when the config enables them on an attention without k_proj / v_proj (Phi-3).
std::vector<std::unique_ptr<QuantizedAttention>> make_quantized_attentions(
    hf::CausalLM& model, const QuantConfig& config);

// The export's KV part: kv_cache_quant_algo ("FP8") when some attention's k/v quantizers are
// enabled, nullopt otherwise; throws Error for a KV quantizer that is not E4M3 per tensor, for
// one without amax and for a mix of enabled and disabled ones.
std::optional<std::string> kv_cache_quant_algo(
    const std::vector<std::unique_ptr<QuantizedAttention>>& attentions);
// `<attention>.k_proj.k_scale` / `.v_proj.v_scale` -> amax.float() / 448, 0-d fp32, on the CPU.
std::map<std::string, at::Tensor> kv_cache_scales(
    const std::vector<std::unique_ptr<QuantizedAttention>>& attentions);

}  // namespace detail
}  // namespace mdist::quant
