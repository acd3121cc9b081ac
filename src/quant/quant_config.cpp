// modelopt 0.47's quantization presets as ordered wildcard rules, and their resolution.
#include "mdist/quant/quant_config.h"

#include <utility>

#include "mdist/error.h"
#include "mdist/quant/wildcard.h"

namespace mdist::quant {
namespace {

QuantRule disable(std::string pattern) {
  return QuantRule{std::move(pattern), std::nullopt, false, std::nullopt, std::nullopt};
}

QuantRule disable_class(std::string parent_class) {
  return QuantRule{"*", std::nullopt, false, std::move(parent_class), std::nullopt};
}

QuantRule configure(std::string pattern, QuantFormat format) {
  return QuantRule{std::move(pattern), std::move(format), true, std::nullopt, std::nullopt};
}

// A preset: disable everything, configure the weight and input quantizers, then modelopt's
// default exclusions (`modelopt_recipes/configs/ptq/presets/model/*.yaml`).
QuantConfig make_preset(std::string name, QuantFormat weight, QuantFormat input) {
  QuantConfig config;
  config.name = std::move(name);
  config.rules = base_disable_all_rules();
  config.rules.push_back(configure("*weight_quantizer", std::move(weight)));
  config.rules.push_back(configure("*input_quantizer", std::move(input)));
  for (auto& rule : default_disabled_quantizer_rules()) config.rules.push_back(std::move(rule));
  config.algorithm = "max";
  return config;
}

}  // namespace

std::vector<QuantRule> base_disable_all_rules() { return {disable("*")}; }

std::vector<QuantRule> default_disabled_quantizer_rules() {
  std::vector<QuantRule> rules;
  for (const char* pattern :
       {"*block_sparse_moe.gate*", "*linear_attn.conv1d*", "*self_attention.conv1d*",
        "*linear_attn.in_proj_a*", "*linear_attn.in_proj_b*", "*lm_head*", "*mixer.conv1d*",
        "*mlp.gate.*", "*mlp.shared_expert_gate.*", "*output_layer*", "*proj_out.*", "*router*",
        "mtp.*", "output.*", "*embed_vision*", "*vision_tower*", "*visual*", "*vision_model*",
        "*multi_modal_projector*"}) {
    rules.push_back(disable(pattern));
  }
  for (const char* parent :
       {"nn.BatchNorm1d", "nn.BatchNorm2d", "nn.BatchNorm3d", "nn.LeakyReLU", "nn.Embedding"}) {
    rules.push_back(disable_class(parent));
  }
  return rules;
}

QuantFormat default_format(QuantizerRole role) {
  return role == QuantizerRole::weight ? QuantFormat::int8_per_row() : QuantFormat::int8();
}

std::vector<std::string> QuantConfig::preset_names() {
  return {"fp8", "int8", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4"};
}

QuantConfig QuantConfig::preset(std::string_view name) {
  // FP8_DEFAULT_CFG: E4M3 per tensor, weights and inputs.
  if (name == "fp8") return make_preset("fp8", QuantFormat::fp8(), QuantFormat::fp8());
  // INT8_DEFAULT_CFG: weights per output row, inputs per tensor.
  if (name == "int8") return make_preset("int8", QuantFormat::int8_per_row(), QuantFormat::int8());
  // INT8_SMOOTHQUANT_CFG: INT8_DEFAULT_CFG's quantizers, calibrated by SmoothQuant (alpha 1.0).
  if (name == "int8_sq") {
    QuantConfig config = make_preset("int8_sq", QuantFormat::int8_per_row(), QuantFormat::int8());
    config.algorithm = "smoothquant";
    return config;
  }
  // NVFP4_DEFAULT_CFG: E2M1 in dynamic blocks of 16 with E4M3 block scales, weights and
  // inputs; max calibration gives each its per-tensor global amax.
  if (name == "nvfp4") return make_preset("nvfp4", QuantFormat::nvfp4(), QuantFormat::nvfp4());
  // INT4_AWQ_CFG: INT4 weights in static blocks of 128, inputs off (their rule has no cfg: the
  // default format, disabled), calibrated by AWQ-lite.
  if (name == "int4_awq") {
    QuantConfig config = make_preset("int4_awq", QuantFormat::int4_blocks(), QuantFormat::int8());
    config.rules.at(2) = disable("*input_quantizer");
    config.algorithm = "awq_lite";
    return config;
  }
  // W4A8_AWQ_BETA_CFG: a SequentialQuantizer on the weights, INT4 in static blocks of 128 and
  // then FP8 per tensor; FP8 per-tensor inputs; calibrated by AWQ-lite.
  if (name == "w4a8_awq") {
    QuantConfig config = make_preset("w4a8_awq", QuantFormat::int4_blocks(), QuantFormat::fp8());
    config.rules.at(1).second_format = QuantFormat::fp8();
    config.algorithm = "awq_lite";
    return config;
  }
  std::string known;
  for (const auto& preset : preset_names()) known += (known.empty() ? "" : ", ") + preset;
  throw InputError("mdist::quant: unknown quantization format '" + std::string(name) +
                   "' (known: " + known + ")");
}

ResolvedQuantizer QuantConfig::resolve(std::string_view quantizer_name,
                                       std::string_view parent_class, QuantizerRole role) const {
  ResolvedQuantizer resolved{default_format(role), true, std::nullopt};
  for (const auto& rule : rules) {
    if (rule.parent_class && *rule.parent_class != parent_class) continue;
    if (!wildcard_match(rule.pattern, quantizer_name)) continue;
    if (rule.format) {
      resolved.format = *rule.format;
      resolved.second_format = rule.second_format;
    }
    resolved.enabled = rule.enable;
  }
  return resolved;
}

}  // namespace mdist::quant
