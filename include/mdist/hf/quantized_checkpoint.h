#pragma once
// Reading a quantized Hugging Face checkpoint in modelopt's unified format (what modelopt
// 0.47's export_hf_checkpoint and mdist::quant::export_hf_checkpoint write) for the formats
// whose weights this loader dequantizes: FP8 (float8_e4m3fn weight, 0-d fp32 weight_scale),
// W8A8_SQ_PER_CHANNEL (int8 weight, fp32 weight_scale per output row), NVFP4 (uint8 weight
// [out, in / 2], two E2M1 codes per byte along the input dim, float8_e4m3fn weight_scale
// [out, in / 16] per block of 16, 0-d fp32 weight_scale_2) and W4A16_AWQ (two int4 output rows
// per uint8, fp32 weight_scale per row and block of 128 inputs; the AWQ pre_quant_scale of
// o_proj / down_proj is applied by the quantization layer, q/k/v's and gate/up's are folded
// into the norms' weights by the export) and W4A8_AWQ (W4A16_AWQ's weights and scales, plus a
// 0-d fp32 weight_scale_2 of the second, FP8 weight stage and FP8 input scales).
//
// At this layer a quantized weight is read back dequantized: W = weight.float() * weight_scale
// (per row for int8; E2M1 value * weight_scale.float() * weight_scale_2 per block for NVFP4, as
// modelopt's NVFP4QTensor.dequantize; for W4A8_AWQ the int4 dequantization fake-quantized to
// E4M3 with amax = weight_scale_2 * 448, the SequentialQuantizer's second stage in modelopt's
// `_fp8_eager` arithmetic), then converted to the model's dtype by the loader, as a
// serving engine that computes in the model's dtype does. A quantized Linear's `weight_scale`,
// `weight_scale_2` and `input_scale` are no model parameters: the loaders skip them without
// reporting them as unknown keys. Applying the input scales (fake-quantizing activations) is the
// quantization layer's part: mdist::quant::apply_checkpoint_quantization (mdist/quant/readback.h).
//
// A KV-cache quantization of kv_cache_quant_algo FP8 is read too: its `k_proj.k_scale` /
// `v_proj.v_scale` are skipped here and applied by apply_checkpoint_quantization. Other
// quant_algo values (W4A8_AWQ, ...) and other KV-cache algorithms are refused
// (check_checkpoint throws naming them): their weights are packed or their scales apply where
// this loader does not apply them, so loading them as plain weights would be wrong silently.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace mdist::hf {

class SafetensorsCheckpoint;

// What a checkpoint directory says about its quantization: config.json's
// `quantization_config` (quant_algo, kv_cache_quant_algo), else hf_quant_config.json's
// `quantization`. nullopt for an ordinary checkpoint.
struct CheckpointQuantization {
  std::string quant_algo;                          // "FP8", "W8A8_SQ_PER_CHANNEL", ...
  std::optional<std::string> kv_cache_quant_algo;  // null, or "FP8" (read); others refused
  std::string source;                              // "config.json" or "hf_quant_config.json"
};
// Throws Error for a malformed quantization entry (not an object, no quant_algo string).
std::optional<CheckpointQuantization> checkpoint_quantization(const std::filesystem::path& dir);

// Whether this loader reads `q` (FP8 or W8A8_SQ_PER_CHANNEL, no KV-cache algorithm or FP8); the
// quant_algo values it reads, for messages.
bool is_readable(const CheckpointQuantization& q);
inline constexpr const char* kReadableQuantAlgos =
    "FP8, W8A8_SQ_PER_CHANNEL, NVFP4, W4A16_AWQ, W4A8_AWQ";

namespace detail {

// `name` (".weight") is stored as float8_e4m3fn, int8 or (INT4 packed) uint8 with a
// `<module>.weight_scale` beside it, or packed NVFP4 (is_nvfp4_weight).
bool is_quantized_weight(const SafetensorsCheckpoint& checkpoint, const std::string& name);
// The dtype a quantized weight is stored in under a readable quant_algo (float8_e4m3fn, int8,
// uint8 for NVFP4's, W4A16_AWQ's and W4A8_AWQ's packed codes); Error for another quant_algo.
at::ScalarType stored_weight_dtype(const std::string& quant_algo);
// `name` is an NVFP4 weight: uint8 [out, in / 2] with a float8_e4m3fn `weight_scale` and a
// `weight_scale_2`.
bool is_nvfp4_weight(const SafetensorsCheckpoint& checkpoint, const std::string& name);
// `name` is a W4A16_AWQ or W4A8_AWQ weight: uint8 [out / 2, in] with a `weight_scale` that is
// not float8_e4m3fn (W4A8_AWQ's also has a `weight_scale_2`).
bool is_int4_weight(const SafetensorsCheckpoint& checkpoint, const std::string& name);
// The shape of the model parameter `name` holds: the stored shape, or [out, in] for a packed
// NVFP4 ([out, in / 2]) or INT4 ([out / 2, in]) weight.
std::vector<int64_t> model_shape(const SafetensorsCheckpoint& checkpoint, const std::string& name);
// `name` is the weight_scale, weight_scale_2 (NVFP4), input_scale or (SmoothQuant)
// pre_quant_scale of a module whose weight is quantized, or a KV-cache scale
// (`<attention>.k_proj.k_scale` / `.v_proj.v_scale`).
bool is_quantization_scale(const SafetensorsCheckpoint& checkpoint, const std::string& name);
// Rows [first_row, first_row + rows) of a quantized weight (all rows when rows < 0),
// dequantized to fp32. Throws Error for a weight_scale that is neither one value nor one per row.
at::Tensor dequantized_rows(const SafetensorsCheckpoint& checkpoint, const std::string& name,
                            std::int64_t first_row, std::int64_t rows);

}  // namespace detail
}  // namespace mdist::hf
