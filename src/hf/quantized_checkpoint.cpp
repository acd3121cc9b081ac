// Reading modelopt's unified FP8 / W8A8_SQ_PER_CHANNEL checkpoints: see
// include/mdist/hf/quantized_checkpoint.h.
#include "mdist/hf/quantized_checkpoint.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fstream>

#include "mdist/error.h"
#include "mdist/hf/safetensors.h"

namespace mdist::hf {
namespace {

std::optional<nlohmann::json> read_json(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return std::nullopt;
  std::ifstream in(path);
  auto parsed = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) throw Error(path.filename().string() + " is not valid JSON");
  return parsed;
}

CheckpointQuantization from_entry(const nlohmann::json& entry, const std::string& source) {
  if (!entry.is_object() || !entry.contains("quant_algo") || !entry["quant_algo"].is_string()) {
    throw Error(source + ": the quantization entry has no quant_algo string");
  }
  CheckpointQuantization q{entry["quant_algo"].get<std::string>(), std::nullopt, source};
  if (const auto kv = entry.find("kv_cache_quant_algo"); kv != entry.end() && !kv->is_null()) {
    q.kv_cache_quant_algo = kv->is_string() ? kv->get<std::string>() : kv->dump();
  }
  // config.json's quantization_config says it as `kv_cache_scheme` (modelopt's
  // convert_hf_quant_config_format: FP8 is {"dynamic": false, "num_bits": 8, "type": "float"},
  // any other algorithm its name).
  if (const auto kv = entry.find("kv_cache_scheme");
      !q.kv_cache_quant_algo && kv != entry.end() && !kv->is_null()) {
    const nlohmann::json fp8 = {{"dynamic", false}, {"num_bits", 8}, {"type", "float"}};
    q.kv_cache_quant_algo = *kv == fp8        ? "FP8"
                            : kv->is_string() ? kv->get<std::string>()
                                              : kv->dump();
  }
  return q;
}

// The module of a tensor name: "model.layers.0.mlp.up_proj.weight" -> "model.layers.0.mlp.up_proj".
std::string module_of(const std::string& name) { return name.substr(0, name.rfind('.')); }

// modelopt's NVFP4QTensor.dequantize: each byte's low nibble is the even column, its high
// nibble the odd one; a nibble is sign << 3 | E2M1 index into {0, .5, 1, 1.5, 2, 3, 4, 6};
// W = value * (weight_scale.float() * weight_scale_2) per block of 16 input channels, in fp32.
at::Tensor dequantize_nvfp4(const at::Tensor& packed, const at::Tensor& block_scale,
                            const at::Tensor& scale_2, const std::string& module) {
  const int64_t rows = packed.dim() == 2 ? packed.size(0) : 0;
  const int64_t columns = packed.dim() == 2 ? packed.size(1) * 2 : 0;
  if (packed.dim() != 2 || block_scale.dim() != 2 || block_scale.size(0) != rows ||
      block_scale.size(1) * 16 != columns || scale_2.numel() != 1 ||
      block_scale.scalar_type() != at::kFloat8_e4m3fn) {
    throw Error("'" + module + "': an NVFP4 weight " + c10::str(packed.sizes()) +
                " needs an e4m3 weight_scale of shape [" + std::to_string(rows) + ", " +
                std::to_string(columns / 16) + "] and a one-value weight_scale_2; got " +
                c10::str(block_scale.scalar_type()) + " " + c10::str(block_scale.sizes()) +
                " and " + std::to_string(scale_2.numel()) + " values");
  }
  const at::Tensor values = at::tensor({0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 0.0f, -0.5f,
                                        -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f});
  const at::Tensor codes =
      at::stack({packed & 0x0F, at::bitwise_right_shift(packed, 4)}, -1).reshape({rows, columns});
  const at::Tensor unpacked = values.index({codes.to(at::kLong)});
  const at::Tensor scale = block_scale.to(at::kFloat) * scale_2.to(at::kFloat).reshape({});
  return (unpacked.view({rows, columns / 16, 16}) * scale.unsqueeze(-1)).reshape({rows, columns});
}

}  // namespace

std::optional<CheckpointQuantization> checkpoint_quantization(const std::filesystem::path& dir) {
  if (const auto config = read_json(dir / "config.json");
      config && config->is_object() && config->contains("quantization_config")) {
    return from_entry((*config)["quantization_config"], "config.json quantization_config");
  }
  if (const auto hf_quant = read_json(dir / "hf_quant_config.json")) {
    if (!hf_quant->is_object() || !hf_quant->contains("quantization")) {
      throw Error("hf_quant_config.json has no \"quantization\" entry");
    }
    return from_entry((*hf_quant)["quantization"], "hf_quant_config.json");
  }
  return std::nullopt;
}

bool is_readable(const CheckpointQuantization& q) {
  return (q.quant_algo == "FP8" || q.quant_algo == "W8A8_SQ_PER_CHANNEL" ||
          q.quant_algo == "NVFP4" || q.quant_algo == "W4A16_AWQ" || q.quant_algo == "W4A8_AWQ") &&
         (!q.kv_cache_quant_algo || *q.kv_cache_quant_algo == "FP8");
}

namespace detail {

bool is_quantized_weight(const SafetensorsCheckpoint& checkpoint, const std::string& name) {
  if (!name.ends_with(".weight") || !checkpoint.contains(name)) return false;
  if (!checkpoint.contains(module_of(name) + ".weight_scale")) return false;
  const auto dtype = checkpoint.info(name).dtype;
  return dtype == at::kFloat8_e4m3fn || dtype == at::kChar || dtype == at::kByte;
}

at::ScalarType stored_weight_dtype(const std::string& quant_algo) {
  if (quant_algo == "FP8") return at::kFloat8_e4m3fn;
  if (quant_algo == "W8A8_SQ_PER_CHANNEL") return at::kChar;
  if (quant_algo == "NVFP4" || quant_algo == "W4A16_AWQ" || quant_algo == "W4A8_AWQ") {
    return at::kByte;
  }
  throw Error("quant_algo " + quant_algo + " is not read back");
}

bool is_nvfp4_weight(const SafetensorsCheckpoint& checkpoint, const std::string& name) {
  if (!name.ends_with(".weight") || !checkpoint.contains(name)) return false;
  const std::string module = module_of(name);
  // W4A8_AWQ's INT4 weights have a weight_scale_2 too, but fp32 block scales.
  return checkpoint.info(name).dtype == at::kByte &&
         checkpoint.contains(module + ".weight_scale") &&
         checkpoint.info(module + ".weight_scale").dtype == at::kFloat8_e4m3fn &&
         checkpoint.contains(module + ".weight_scale_2");
}

bool is_int4_weight(const SafetensorsCheckpoint& checkpoint, const std::string& name) {
  return is_quantized_weight(checkpoint, name) && checkpoint.info(name).dtype == at::kByte &&
         !is_nvfp4_weight(checkpoint, name);
}

std::vector<int64_t> model_shape(const SafetensorsCheckpoint& checkpoint, const std::string& name) {
  std::vector<int64_t> shape = checkpoint.info(name).shape;
  if (shape.empty()) return shape;
  // NVFP4: two E2M1 codes per byte along the input dim; W4A16_AWQ: two int4 output rows per
  // byte.
  if (is_nvfp4_weight(checkpoint, name))
    shape.back() *= 2;
  else if (is_int4_weight(checkpoint, name))
    shape.front() *= 2;
  return shape;
}

bool is_quantization_scale(const SafetensorsCheckpoint& checkpoint, const std::string& name) {
  // The KV-cache scales (modelopt's k_bmm / v_bmm quantizers) are named after k_proj / v_proj
  // whatever those Linears' own format.
  if (name.ends_with(".k_proj.k_scale") || name.ends_with(".v_proj.v_scale")) {
    return checkpoint.contains(name);
  }
  if (!name.ends_with(".weight_scale") && !name.ends_with(".weight_scale_2") &&
      !name.ends_with(".input_scale") && !name.ends_with(".pre_quant_scale")) {
    return false;
  }
  return is_quantized_weight(checkpoint, module_of(name) + ".weight");
}

namespace {

// W4A16_AWQ: uint8 [out / 2, in], byte[r, c] = (q[2r, c] & 15) | (q[2r + 1, c] & 15) << 4
// (modelopt's pack_int4_in_uint8), weight_scale fp32 [out, in / block]: rows
// [first_row, first_row + rows) as q * scale of their block.
at::Tensor dequantized_int4_rows(const SafetensorsCheckpoint& checkpoint, const std::string& name,
                                 std::int64_t first_row, std::int64_t rows) {
  const auto packed_shape = checkpoint.info(name).shape;
  const std::string scale_name = module_of(name) + ".weight_scale";
  const at::Tensor scale = checkpoint.tensor(scale_name).to(at::kFloat);
  const std::int64_t out = 2 * packed_shape.front(), in = packed_shape.back();
  if (packed_shape.size() != 2 || scale.dim() != 2 || scale.size(0) != out || scale.size(1) == 0 ||
      in % scale.size(1) != 0) {
    throw Error("'" + scale_name + "' has shape " + c10::str(scale.sizes()) + " for '" + name +
                "' of packed shape " + c10::str(c10::IntArrayRef(packed_shape)) +
                "; INT4 weights are read back with one scale per output row and block of inputs");
  }
  const std::int64_t first = rows < 0 ? 0 : first_row, count = rows < 0 ? out : rows;
  const std::int64_t p0 = first / 2, p1 = (first + count + 1) / 2;
  const at::Tensor bytes = checkpoint.read_rows(name, p0, p1 - p0).to(at::kInt);
  const at::Tensor nibbles =
      at::stack({bytes.bitwise_and(15), bytes.bitwise_right_shift(4).bitwise_and(15)}, 1)
          .reshape({2 * (p1 - p0), in});
  const at::Tensor codes =
      at::where(nibbles >= 8, nibbles - 16, nibbles).narrow(0, first - 2 * p0, count);
  const at::Tensor int4 =
      codes.to(at::kFloat) * scale.narrow(0, first, count).repeat_interleave(in / scale.size(1), 1);
  const std::string scale_2_name = module_of(name) + ".weight_scale_2";
  if (!checkpoint.contains(scale_2_name)) return int4;
  // W4A8_AWQ: the SequentialQuantizer's second stage, E4M3 fake quant with amax =
  // weight_scale_2 * 448, in modelopt's `_fp8_eager` arithmetic (mdist::quant's
  // e4m3_fake_quant, which this layer, below quant, cannot call).
  const at::Tensor scale_2 = checkpoint.tensor(scale_2_name).to(at::kFloat);
  if (scale_2.numel() != 1) {
    throw Error("'" + scale_2_name + "' has " + std::to_string(scale_2.numel()) +
                " values; one per tensor is read back");
  }
  const at::Tensor amax = scale_2.reshape({}) * 448.0;
  const at::Tensor safe_amax = at::where(amax <= 1.0 / (1 << 24), at::ones_like(amax), amax);
  const at::Tensor fp8_scale = at::reciprocal(safe_amax) * 448.0;
  const at::Tensor fp8_scale_inv = at::reciprocal(fp8_scale);
  return (int4 * fp8_scale).clamp(-448.0, 448.0).to(at::kFloat8_e4m3fn).to(at::kFloat) *
         fp8_scale_inv;
}

}  // namespace

at::Tensor dequantized_rows(const SafetensorsCheckpoint& checkpoint, const std::string& name,
                            std::int64_t first_row, std::int64_t rows) {
  if (is_int4_weight(checkpoint, name))
    return dequantized_int4_rows(checkpoint, name, first_row, rows);
  const at::Tensor stored =
      rows < 0 ? checkpoint.tensor(name) : checkpoint.read_rows(name, first_row, rows);
  if (is_nvfp4_weight(checkpoint, name)) {
    const std::string scale_name = module_of(name) + ".weight_scale";
    const at::Tensor block_scale = rows < 0 ? checkpoint.tensor(scale_name)
                                            : checkpoint.read_rows(scale_name, first_row, rows);
    return dequantize_nvfp4(stored, block_scale,
                            checkpoint.tensor(module_of(name) + ".weight_scale_2"),
                            module_of(name));
  }
  const at::Tensor scale = checkpoint.tensor(module_of(name) + ".weight_scale").to(at::kFloat);
  const at::Tensor values = stored.to(at::kFloat);
  const int64_t out_rows = checkpoint.info(name).shape.front();
  if (scale.numel() == 1) return values * scale.reshape({});
  // One scale per output row (W8A8_SQ_PER_CHANNEL): this read's rows of it.
  if (scale.dim() == 1 && scale.size(0) == out_rows) {
    const at::Tensor own = rows < 0 ? scale : scale.narrow(0, first_row, rows);
    return values * own.unsqueeze(1);
  }
  throw Error("'" + module_of(name) + ".weight_scale' has shape " + c10::str(scale.sizes()) +
              "; only one scale per tensor or per output row can be read back (block scales "
              "are not implemented yet)");
}

}  // namespace detail
}  // namespace mdist::hf
