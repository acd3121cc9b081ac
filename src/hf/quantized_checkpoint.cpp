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
  return q;
}

// The module of a tensor name: "model.layers.0.mlp.up_proj.weight" -> "model.layers.0.mlp.up_proj".
std::string module_of(const std::string& name) { return name.substr(0, name.rfind('.')); }

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
          q.quant_algo == "W4A16_AWQ") &&
         !q.kv_cache_quant_algo;
}

namespace detail {

bool is_quantized_weight(const SafetensorsCheckpoint& checkpoint, const std::string& name) {
  if (!name.ends_with(".weight") || !checkpoint.contains(name)) return false;
  const auto dtype = checkpoint.info(name).dtype;
  return (dtype == at::kFloat8_e4m3fn || dtype == at::kChar || dtype == at::kByte) &&
         checkpoint.contains(module_of(name) + ".weight_scale");
}

bool is_quantization_scale(const SafetensorsCheckpoint& checkpoint, const std::string& name) {
  if (!name.ends_with(".weight_scale") && !name.ends_with(".input_scale") &&
      !name.ends_with(".pre_quant_scale")) {
    return false;
  }
  return is_quantized_weight(checkpoint, module_of(name) + ".weight");
}

std::vector<std::int64_t> dequantized_shape(const SafetensorsCheckpoint& checkpoint,
                                            const std::string& name) {
  std::vector<std::int64_t> shape = checkpoint.info(name).shape;
  if (is_quantized_weight(checkpoint, name) && checkpoint.info(name).dtype == at::kByte &&
      !shape.empty()) {
    shape.front() *= 2;  // two int4 rows per byte
  }
  return shape;
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
  return codes.to(at::kFloat) *
         scale.narrow(0, first, count).repeat_interleave(in / scale.size(1), 1);
}

}  // namespace

at::Tensor dequantized_rows(const SafetensorsCheckpoint& checkpoint, const std::string& name,
                            std::int64_t first_row, std::int64_t rows) {
  if (checkpoint.info(name).dtype == at::kByte) {
    return dequantized_int4_rows(checkpoint, name, first_row, rows);
  }
  const at::Tensor stored =
      rows < 0 ? checkpoint.tensor(name) : checkpoint.read_rows(name, first_row, rows);
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
