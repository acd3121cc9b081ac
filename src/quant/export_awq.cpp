// modelopt 0.47's W4A16_AWQ export: see src/quant/export_awq.h.
#include "src/quant/export_awq.h"

#include <ATen/ATen.h>

#include <utility>

#include "mdist/error.h"
#include "mdist/quant/quantize.h"

namespace mdist::quant::detail {
namespace {

// INT4's maxbound (2^3 - 1), E4M3's.
constexpr double kInt4Bound = 7.0;
constexpr double kFp8Bound = 448.0;

// The norm whose output the Linear reads when it shares that input with its siblings (modelopt
// finds these with a dummy forward; in the Llama-like decoders mdist builds they are q/k/v after
// input_layernorm and gate/up after post_attention_layernorm). Empty for the others.
std::pair<std::string, std::string> shared_input(const std::string& name) {
  const auto dot = name.rfind('.');
  const std::string parent = name.substr(0, dot), leaf = name.substr(dot + 1);
  const auto layer = parent.substr(0, parent.rfind('.'));
  if (leaf == "q_proj" || leaf == "k_proj" || leaf == "v_proj") {
    return {parent + ".qkv", layer + ".input_layernorm.weight"};
  }
  if (leaf == "gate_proj" || leaf == "up_proj") {
    return {parent + ".gate_up", layer + ".post_attention_layernorm.weight"};
  }
  return {name, ""};
}

// The per-block max |W| as modelopt's max calibration takes it, [out, in / block], in W's dtype.
at::Tensor block_amax(const at::Tensor& weight, int64_t block) {
  return weight.reshape({weight.size(0), weight.size(1) / block, block}).abs().amax({2});
}

// pack_int4_in_uint8: rows 2r and 2r + 1 of the int4 codes in one byte, low nibble first.
at::Tensor pack_int4(const at::Tensor& codes) {
  const at::Tensor q = codes.to(at::kInt);
  const at::Tensor even = q.slice(0, 0, q.size(0), 2).bitwise_and(15);
  const at::Tensor odd = q.slice(0, 1, q.size(0), 2).bitwise_and(15);
  return even.bitwise_or(odd.bitwise_left_shift(4)).to(at::kByte).contiguous();
}

}  // namespace

void export_int4_awq(const std::vector<AwqLayer>& layers, int64_t block_size, bool w4a8,
                     std::map<std::string, at::Tensor>& tensors) {
  struct Layer {
    at::Tensor weight;
    at::Tensor pre_quant_scale;
    bool fused = false;
    at::Tensor blocks_amax;    // [out, in / block]
    at::Tensor input_amax;     // W4A8
    at::Tensor weight_amax_2;  // W4A8: the FP8 stage's, max |W|
  };
  std::map<std::string, Layer> state;
  std::map<std::string, std::vector<std::string>> groups;
  std::vector<std::string> group_order;
  for (const AwqLayer& layer : layers) {
    const at::Tensor weight = tensors.at(layer.name + ".weight");
    if (weight.size(0) % 2 != 0) {
      throw Error("mdist::quant: export_hf_checkpoint: " + layer.name + " has out_features " +
                  std::to_string(weight.size(0)) + "; INT4 packs two output rows per byte");
    }
    if (w4a8 && !layer.input_amax.defined()) {
      throw Error("mdist::quant: export_hf_checkpoint: " + layer.name +
                  ".input_quantizer has no amax (no calibration input reached it)");
    }
    state[layer.name] = {layer.smoothing.defined()
                             ? smoothed_weight(weight, layer.smoothing.to(weight.device()))
                             : weight,
                         layer.pre_quant_scale.to(weight.device()),
                         false,
                         at::Tensor(),
                         w4a8 ? layer.input_amax.to(weight.device()) : at::Tensor(),
                         at::Tensor()};
    Layer& added = state[layer.name];
    added.blocks_amax = layer.weight_amax.defined()
                            ? layer.weight_amax.to(weight.device())
                                  .reshape({weight.size(0), weight.size(1) / block_size})
                            : block_amax(added.weight, block_size);
    const std::string group = shared_input(layer.name).first;
    if (!groups.contains(group)) group_order.push_back(group);
    groups[group].push_back(layer.name);
  }
  for (const auto& group : group_order) {
    const auto& members = groups.at(group);
    if (members.size() < 2) continue;
    std::vector<at::Tensor> scales;
    for (const auto& m : members) scales.push_back(state.at(m).pre_quant_scale);
    const at::Tensor mean = at::mean(at::stack(scales), 0);
    for (const auto& m : members) {
      Layer& layer = state.at(m);
      if (!at::equal(layer.pre_quant_scale, mean)) {
        layer.weight = (layer.weight.to(at::kFloat) * layer.pre_quant_scale.to(at::kFloat) /
                        mean.to(at::kFloat))
                           .to(layer.weight.scalar_type());
        layer.pre_quant_scale = mean;
        layer.blocks_amax = block_amax(layer.weight, block_size);
      }
      layer.fused = true;
    }
    if (w4a8) {
      // preprocess_linear_fusion: the group's input amax and second-stage weight amax are the
      // max over its members, the latter taken after the re-fold (_update_pre_quant_scale
      // recalibrates both stages).
      std::vector<at::Tensor> inputs, weights;
      for (const auto& m : members) {
        inputs.push_back(state.at(m).input_amax.reshape({}));
        weights.push_back(state.at(m).weight.abs().amax());
      }
      const at::Tensor input = at::max(at::stack(inputs)), weight = at::max(at::stack(weights));
      for (const auto& m : members) {
        state.at(m).input_amax = input;
        state.at(m).weight_amax_2 = weight;
      }
    }
    const std::string norm = shared_input(members.front()).second;
    if (!tensors.contains(norm)) {
      throw Error("mdist::quant: export_hf_checkpoint: " + group + " shares an input but " + norm +
                  " is not in the model; its pre_quant_scale has nowhere to be folded");
    }
    const at::Tensor& weight = tensors.at(norm);
    tensors[norm] = (weight * mean.to(weight.device())).to(weight.scalar_type());
  }
  for (const AwqLayer& layer : layers) {
    const Layer& s = state.at(layer.name);
    const at::Tensor scale = scaling_factor(s.blocks_amax, kInt4Bound);
    const at::Tensor codes =
        (s.weight / scale.repeat_interleave(block_size, 1)).round().clamp(-8, 7).to(at::kChar);
    tensors[layer.name + ".weight"] = pack_int4(codes);
    tensors[layer.name + ".weight_scale"] = scale;
    if (!s.fused) tensors[layer.name + ".pre_quant_scale"] = s.pre_quant_scale;
    if (w4a8) {
      const at::Tensor weight_amax_2 =
          s.weight_amax_2.defined() ? s.weight_amax_2 : s.weight.abs().amax();
      tensors[layer.name + ".weight_scale_2"] = scaling_factor(weight_amax_2, kFp8Bound).squeeze();
      tensors[layer.name + ".input_scale"] = scaling_factor(s.input_amax, kFp8Bound).squeeze();
    }
  }
}

}  // namespace mdist::quant::detail
