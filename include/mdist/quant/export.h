#pragma once
// The unified Hugging Face checkpoint of a quantized model, as modelopt 0.47's
// `export_hf_checkpoint` (`export/unified_export_hf.py`) writes it for the FP8 and INT8
// presets, the format vLLM (FP8) and TensorRT-LLM load:
//
//   auto quantizers = mdist::quant::quantize(model, QuantConfig::preset("fp8"), loop);
//   mdist::quant::export_hf_checkpoint(model, *quantizers, "out");
//
// out/model.safetensors: every parameter under its checkpoint name, and per quantized Linear
//   fp8  (quant_algo FP8):  weight float8_e4m3fn [out, in] = e4m3(W / weight_scale),
//                           weight_scale f32 [] = amax_w / 448, input_scale f32 [] = amax / 448
//   int8 (W8A8_SQ_PER_CHANNEL): weight int8 [out, in] = clamp(round_half_even(W / s[:, None]),
//                           -128, 127), weight_scale f32 [out] = row amax / 127,
//                           input_scale f32 [] = amax / 127
//   nvfp4 (quant_algo NVFP4): weight uint8 [out, in/2] (E2M1 codes, two per byte along the
//                           input dim), weight_scale float8_e4m3fn [out, in/16] (per block of
//                           16), weight_scale_2 f32 [] = amax_w / 2688, input_scale f32 [] =
//                           amax / 2688; q/k/v and gate/up share the group's largest weight and
//                           input amax (src/quant/nvfp4_export.h has the arithmetic);
//   with modelopt's export arithmetic (not the fake quant's: it divides by the scale, where
//   fake quant multiplies by its reciprocal). FP8 weights: amax in fp32, a 0-d scale, W divided
//   in the weights' dtype (bf16 stays bf16). INT8 weights and all input scales: the amax first
//   sanitised as modelopt's `export_amax` (0 or NaN -> maxbound, clamped to the amax dtype's
//   [tiny, max]); the [out, 1] scale promotes bf16 weights to fp32 for the division;
// out/hf_quant_config.json: {"producer", "quantization": {"quant_algo", "kv_cache_quant_algo":
//   null, ("group_size": 16 for NVFP4,) "exclude_modules"}}, exclude_modules summarised with
//   modelopt's prefix wildcards;
// out/config.json: the model's config with `quantization_config` (FP8: config_groups with
//   8-bit float weights and inputs, NVFP4: 4-bit float with group_size 16; all: ignore, quant_algo,
//   producer, quant_method "modelopt").
// The producer is {"name": "modelopt", "version": "0.47.0 (mdist)"}: the format's name, so
// that loaders that check it accept the checkpoint, and the version whose format this is.
//
// Every file is written atomically (a temporary file renamed into place), by rank 0 only.
// Collective: every rank calls it. A model wrapped by fully_shard is gathered, one split by
// tensor parallelism joined (as hf::save_pretrained does), and a column-parallel per-row
// weight amax joined from the ranks' rows; the other amaxes are equal on every rank after
// quantize's sync. Under tensor parallelism the activation amaxes (so input_scale) can differ
// from one process's in the last bits (the split sums in another order); weights and weight
// scales do not. Under expert parallelism (max-calibrated formats) rank 0 gathers the other
// ranks' experts' weights as hf::save_pretrained does, and every rank sends its experts'
// formats and synced amaxes; the checks of all ranks are agreed on before any collective.
// Scope, each refused with an Error: a model both expert- and tensor-parallel, weights
// other than fp32 and bf16, layers quantized in another way than the presets (mixed
// precision, weight-only). modelopt's fused-layer preprocessing is reproduced where it changes
// something: SmoothQuant's shared pre_quant_scale, NVFP4's shared global amaxes; FP8 is
// excluded from it, and INT8's q/k/v and gate/up share one input (so one input amax already)
// and keep per-row weight scales.
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/parallelize.h"
#include "mdist/quant/quantize.h"

namespace mdist::quant {

// `parallelism`: how the model is split (hf::apply_parallelism's result; empty when not).
void export_hf_checkpoint(hf::CausalLM& model, const ModelQuantizers& quantizers,
                          const std::filesystem::path& dir,
                          const hf::Parallelism& parallelism = hf::Parallelism());

// amax_state_dict() of the whole model: under tensor parallelism a column-parallel per-row
// weight amax (kept per shard by quantize) joined from the tensor-parallel group's rows, as the
// export joins it; under expert parallelism every rank's experts (gathered over the world);
// every other amax is whole already. Collective over the tensor-parallel group (under expert
// parallelism over the world; every rank calls it); the same result on every rank.
std::map<std::string, at::Tensor> whole_amax_state_dict(
    const ModelQuantizers& quantizers, const hf::Parallelism& parallelism = hf::Parallelism());

// modelopt's `_prefix_wildcard_summarize_exclude_modules`: the unquantized module names
// summarised by prefix wildcards at dot boundaries ("model.layers.0.mlp.gate*" or the pair
// "x", "x.*" written as "x.*") that match no quantized module; sorted.
std::vector<std::string> summarize_exclude_modules(const std::vector<std::string>& unquantized,
                                                   const std::vector<std::string>& quantized);

}  // namespace mdist::quant
