#pragma once
// A quantization configuration as modelopt 0.47 structures one (`QuantizeConfig`,
// `quantization/config.py`; applied by `conversion.py`, `set_quantizer_by_cfg`): an ordered
// list of wildcard rules over quantizer names, later rules winning, and a calibration
// algorithm.
//
//   const auto config = mdist::quant::QuantConfig::preset("fp8");   // mtq.FP8_DEFAULT_CFG
//   const auto q = config.resolve("model.layers.0.mlp.up_proj.weight_quantizer", "nn.Linear",
//                                 mdist::quant::QuantizerRole::weight);
//   // q.enabled == true, q.format == QuantFormat::fp8()
//
// A quantizer's name is its module's full name plus `.input_quantizer` / `.weight_quantizer`,
// e.g. `model.layers.0.self_attn.q_proj.weight_quantizer`, matched with Python's fnmatch
// (wildcard.h). A rule with attributes (`cfg`) replaces the quantizer's format entirely and
// sets its enable flag (true unless the rule says otherwise); a rule without only turns it on
// or off, keeping its format. A rule may be restricted to quantizers whose module is of one
// class (modelopt's `parent_class`, e.g. "nn.Embedding"). A quantizer nothing matches keeps
// its defaults, enabled: modelopt's QuantLinear defaults, INT8 per tensor for the input and
// INT8 per row for the weight. Every preset starts with modelopt's "*: disabled", so only what
// the preset turns on is quantized.
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mdist/quant/format.h"

namespace mdist::quant {

// Which of a Linear's quantizers: its input (activations) or its weight.
enum class QuantizerRole { input, weight };

struct QuantRule {
  std::string pattern;  // fnmatch wildcard on the quantizer's full name
  // modelopt's `cfg`: with a format, a full replacement of the attributes; without, the rule
  // only sets `enable`.
  std::optional<QuantFormat> format;
  bool enable = true;
  // modelopt's `parent_class` (its QuantModuleRegistry names: "nn.Linear", "nn.Embedding",
  // "nn.BatchNorm1d", ...): the rule applies only to quantizers of modules of this class.
  std::optional<std::string> parent_class;
  // modelopt's SequentialQuantizer (a `cfg` list of two attribute sets, W4A8_AWQ_BETA_CFG's
  // weights): the tensor is quantized with `format`, then the result with this. Only read with
  // a `format`.
  std::optional<QuantFormat> second_format = std::nullopt;
};

// What the rules give one quantizer.
struct ResolvedQuantizer {
  QuantFormat format;
  bool enabled;
  // The second stage of a SequentialQuantizer (QuantRule::second_format).
  std::optional<QuantFormat> second_format = std::nullopt;
};

struct QuantConfig {
  // modelopt's preset names, lower case, as `mdist quantize --format` will take them:
  // "fp8" (FP8_DEFAULT_CFG), "int8" (INT8_DEFAULT_CFG), "int8_sq" (INT8_SMOOTHQUANT_CFG:
  // int8's quantizers, algorithm "smoothquant"), "nvfp4" (NVFP4_DEFAULT_CFG: E2M1 weights and
  // inputs in dynamic blocks of 16 with E4M3 block scales), "int4_awq" (INT4_AWQ_CFG: INT4
  // weights in blocks of 128, inputs off, algorithm "awq_lite"), "w4a8_awq"
  // (W4A8_AWQ_BETA_CFG: weights INT4 in blocks of 128 then FP8 per tensor, inputs FP8 per
  // tensor, algorithm "awq_lite"). Throws InputError naming the known presets for any other
  // name.
  static QuantConfig preset(std::string_view name);
  // The names preset() knows.
  static std::vector<std::string> preset_names();

  // The quantizer named `quantizer_name`, of a module of class `parent_class`, after the rules.
  ResolvedQuantizer resolve(std::string_view quantizer_name, std::string_view parent_class,
                            QuantizerRole role) const;

  std::string name;              // the preset's name ("fp8"), or the user's
  std::vector<QuantRule> rules;  // in order; later rules win
  // "max", "smoothquant" or "awq_lite" (modelopt's `algorithm` names).
  std::string algorithm = "max";
  // SmoothQuant's migration strength (modelopt's SmoothQuantCalibConfig.alpha): the smoothing
  // scale is max|W_c|^(1 - alpha) / max|x_c|^alpha, alpha in [0, 1] as modelopt accepts it
  // (quantize() throws InputError otherwise). Only read by "smoothquant".
  double smoothquant_alpha = 1.0;
  // modelopt's `pass_through_bwd` for every quantizer the rules create (its default, true: the
  // gradient passes through fake quant unchanged; false: the clipped STE, zero where
  // |x| > amax). Only training reads it.
  bool pass_through_bwd = true;
};

// modelopt 0.47's `_base_disable_all`: {"*": enable false}.
std::vector<QuantRule> base_disable_all_rules();
// modelopt 0.47's `_default_disabled_quantizer_cfg`, in its order: lm_head, routers and gates,
// conv1d of linear-attention / Mamba mixers, MTP and output layers, vision towers, and every
// quantizer of BatchNorm, LeakyReLU and Embedding modules.
std::vector<QuantRule> default_disabled_quantizer_rules();

// modelopt's defaults for a QuantLinear's quantizers (QUANT_DESC_8BIT_PER_TENSOR and
// QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW).
QuantFormat default_format(QuantizerRole role);

}  // namespace mdist::quant
