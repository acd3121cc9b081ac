// mdist::hf::CausalLM: the Llama-family decoder with Hugging Face names and numerics.
#include "mdist/hf/causal_lm.h"

#include <cmath>
#include <limits>
#include <map>
#include <numbers>
#include <optional>
#include <sstream>
#include <string_view>
#include <tuple>
#include <utility>

#include "mdist/error.h"
#include "mdist/nn/checkpoint.h"
#include "mdist/nn/hooks.h"
#include "mdist/nn/meta.h"

namespace mdist::hf {
namespace {

torch::nn::Linear linear(int64_t in, int64_t out, bool bias, c10::Device device) {
  if (!device.is_meta()) return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
  // LinearImpl allocates and initialises its weight in its constructor, with no device
  // option: build it 1 x 1, then give it meta parameters of the real shape and the real
  // options, so not even one full projection is allocated.
  torch::nn::Linear module(torch::nn::LinearOptions(1, 1).bias(bias));
  module->options.in_features(in).out_features(out);
  const auto meta = at::TensorOptions().dtype(module->weight.scalar_type()).device(c10::kMeta);
  mdist::nn::assign_in_place(module->weight, at::empty({out, in}, meta));
  if (bias) mdist::nn::assign_in_place(module->bias, at::empty({out}, meta));
  return module;
}

torch::nn::Embedding embedding(torch::nn::EmbeddingOptions options, c10::Device device) {
  if (!device.is_meta()) return torch::nn::Embedding(options);
  // A given _weight is taken as the parameter, with no allocation and no initialisation.
  const at::Tensor weight = at::empty({options.num_embeddings(), options.embedding_dim()},
                                      at::TensorOptions().dtype(at::kFloat).device(c10::kMeta));
  torch::nn::Embedding module(options._weight(weight));
  module->options._weight(at::Tensor());  // the options need not keep the tensor alive
  return module;
}

// [B, H_kv, T, D] -> [B, H_kv * repeats, T, D], each kv head repeated `repeats` times in
// place (HF's repeat_kv).
at::Tensor repeat_kv(const at::Tensor& x, int64_t repeats) {
  if (repeats == 1) return x;
  const int64_t batch = x.size(0), kv = x.size(1), time = x.size(2), dim = x.size(3);
  return x.unsqueeze(2)
      .expand({batch, kv, repeats, time, dim})
      .reshape({batch, kv * repeats, time, dim});
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i == 8) return out + ", ... (" + std::to_string(names.size()) + " in all)";
    out += (i ? ", " : "") + names[i];
  }
  return out;
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

}  // namespace

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_, c10::Device device, bool weight_in_fp32_,
                         bool unit_offset_)
    : eps(eps_), weight_in_fp32(weight_in_fp32_), unit_offset(unit_offset_) {
  // The identity at initialisation: weight 1, or 0 under the (1 + weight) of Gemma.
  const auto options = torch::TensorOptions().device(device);
  weight = register_parameter(
      "weight", unit_offset ? torch::zeros({dim}, options) : torch::ones({dim}, options));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor mean = mean_square ? mean_square(h) : h.pow(2).mean(-1, /*keepdim=*/true);
  const at::Tensor normed = h * at::rsqrt(mean + eps);
  if (unit_offset) return (normed * (weight.to(at::kFloat) + 1.0)).to(x.scalar_type());
  if (weight_in_fp32) return (weight * normed).to(x.scalar_type());
  return weight * normed.to(x.scalar_type());
}

namespace {

RMSNorm rms_norm(int64_t dim, const LlamaConfig& c, c10::Device device) {
  return RMSNorm(dim, c.rms_norm_eps, device, c.fp32_norm_weight_and_rotary, c.norm_unit_offset);
}

// transformers' eager attention, which the soft-capped scores need (scaled_dot_product_attention
// has no hook between the product and the softmax): scores = q k^T * scale, then
// tanh(scores / cap) * cap, then the mask (bool [B, 1, T, K], true where allowed; undefined:
// causal when `causal`, else every key), softmax in fp32 cast back, times v. q [B, H, T, D],
// k and v [B, H, K, D] (already repeated to H heads).
at::Tensor softcapped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& mask, bool causal, double scale, double cap) {
  at::Tensor scores = at::matmul(q, k.transpose(2, 3)) * scale;
  scores = at::tanh(scores / cap) * cap;
  at::Tensor allowed = mask;
  if (!allowed.defined() && causal) {
    const int64_t time = q.size(2), keys = k.size(2);
    allowed = at::ones({time, keys}, q.options().dtype(at::kBool)).tril(keys - time);
  }
  if (allowed.defined()) {
    // -inf where transformers adds the dtype's lowest value: both give a weight of exactly 0
    // (no row is fully masked: DecoderModel lets such rows see every key).
    scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  }
  const at::Tensor weights = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(weights, v);
}

}  // namespace

AttentionImpl::AttentionImpl(const LlamaConfig& c, c10::Device device)
    : qk_norm_full_width(c.qk_norm_full_width),
      heads(c.num_attention_heads),
      kv_heads(c.num_key_value_heads),
      head_dim(c.head_dim),
      // Gemma's query_pre_attn_scalar ** -0.5, as Python computes it; none:
      // scaled_dot_product_attention's default 1 / sqrt(head_dim).
      scale(c.query_pre_attn_scalar
                ? std::optional(std::pow(static_cast<double>(*c.query_pre_attn_scalar), -0.5))
                : std::nullopt),
      softcap(c.attn_logit_softcapping) {
  if (c.fused_projections) {
    qkv_proj = register_module(
        "qkv_proj", linear(c.hidden_size, (heads + 2 * kv_heads) * head_dim, c.qkv_bias, device));
  } else {
    q_proj = register_module("q_proj", linear(c.hidden_size, heads * head_dim, c.qkv_bias, device));
    k_proj =
        register_module("k_proj", linear(c.hidden_size, kv_heads * head_dim, c.qkv_bias, device));
    v_proj =
        register_module("v_proj", linear(c.hidden_size, kv_heads * head_dim, c.qkv_bias, device));
  }
  o_proj = register_module("o_proj", linear(heads * head_dim, c.hidden_size, c.o_bias, device));
  if (c.qk_norm) {
    const int64_t q_width = c.qk_norm_full_width ? heads * head_dim : head_dim;
    const int64_t k_width = c.qk_norm_full_width ? kv_heads * head_dim : head_dim;
    q_norm = register_module("q_norm", rms_norm(q_width, c, device));
    k_norm = register_module("k_norm", rms_norm(k_width, c, device));
  }
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                  const at::Tensor& mask, LayerKvCache* cache) {
  const int64_t batch = x.size(0), time = x.size(1);
  at::Tensor q, k, v;
  if (qkv_proj) {  // rows: q, then k, then v
    const at::Tensor qkv = mdist::nn::call(qkv_proj, x);
    q = qkv.narrow(-1, 0, heads * head_dim);
    k = qkv.narrow(-1, heads * head_dim, kv_heads * head_dim);
    v = qkv.narrow(-1, (heads + kv_heads) * head_dim, kv_heads * head_dim);
  } else {
    q = mdist::nn::call(q_proj, x);
    k = mdist::nn::call(k_proj, x);
    v = mdist::nn::call(v_proj, x);
  }
  if (q_norm && qk_norm_full_width) {  // OLMo 2: over all heads at once
    q = mdist::nn::call(q_norm, q);
    k = mdist::nn::call(k_norm, k);
  }
  q = q.view({batch, time, heads, head_dim});
  k = k.view({batch, time, kv_heads, head_dim});
  v = v.view({batch, time, kv_heads, head_dim});
  if (q_norm && !qk_norm_full_width) {  // Qwen3: per head
    q = mdist::nn::call(q_norm, q);
    k = mdist::nn::call(k_norm, k);
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  v = v.transpose(1, 2);
  // fp32 tables (OLMo 2) rotate in fp32; the result goes back to the projections' dtype.
  q = apply_rotary(q, cos, sin).to(x.scalar_type());
  k = apply_rotary(k, cos, sin).to(x.scalar_type());
  // Fake quant with a fixed per-tensor scale is elementwise, so quantizing this step's keys
  // before they enter the cache equals modelopt's quantizing the whole cache every step.
  k = mdist::nn::call(k_bmm, k);
  v = mdist::nn::call(v_bmm, v);
  const int64_t repeats = heads / kv_heads;
  at::Tensor out;
  if (softcap) {
    // Without a mask: causal when the cache was empty (or there is none), else every key
    // (DecoderModel leaves the mask out after cached keys only for one query).
    const bool causal = cache == nullptr || cache->length() == 0;
    if (cache != nullptr) std::tie(k, v) = cache->append(k, v);
    out = softcapped_attention(q, repeat_kv(k, repeats), repeat_kv(v, repeats), mask, causal,
                               scale.value_or(1.0 / std::sqrt(static_cast<double>(head_dim))),
                               *softcap);
  } else if (cache == nullptr) {
    k = repeat_kv(k, repeats);
    v = repeat_kv(v, repeats);
    out = mask.defined() ? at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale)
                         : at::scaled_dot_product_attention(q, k, v, {}, 0.0, true, scale);
  } else {
    // Cached as transformers caches: after RoPE, before the grouped-query repeat.
    std::tie(k, v) = cache->append(k, v);
    // Repeating the whole cache's KV heads every step would copy it every step (the step time
    // would grow with the sequence): instead the query heads sharing a KV head are stacked
    // along the query axis, [B, H_kv, repeats * T, D], which is the same attention row by row.
    // No mask: the cache was empty (causal), or one query that sees every key (the caller
    // leaves the mask out only then).
    const at::Tensor grouped = q.reshape({batch, kv_heads, repeats * time, head_dim});
    at::Tensor grouped_mask;
    if (mask.defined()) {
      grouped_mask = mask.unsqueeze(2)
                         .expand({batch, 1, repeats, time, mask.size(-1)})
                         .reshape({batch, 1, repeats * time, mask.size(-1)});
    }
    const bool causal = !mask.defined() && cache->length() == time;
    if (causal && repeats > 1 && time > 1) {  // stacked queries are not one causal triangle
      k = repeat_kv(k, repeats);
      v = repeat_kv(v, repeats);
      out = at::scaled_dot_product_attention(q, k, v, {}, 0.0, true, scale);
    } else {
      // An undefined tensor is not "no mask" to scaled_dot_product_attention: nullopt is.
      const std::optional<at::Tensor> no_or_mask =
          grouped_mask.defined() ? std::optional<at::Tensor>(grouped_mask) : std::nullopt;
      out = at::scaled_dot_product_attention(grouped, k, v, no_or_mask, 0.0, causal, scale)
                .reshape({batch, heads, time, head_dim});
    }
  }
  return mdist::nn::call(o_proj, out.transpose(1, 2).reshape({batch, time, heads * head_dim}));
}

MLPImpl::MLPImpl(const LlamaConfig& c, c10::Device device)
    : gelu_tanh(c.hidden_act == "gelu_pytorch_tanh") {
  if (c.fused_projections) {
    gate_up_proj = register_module(
        "gate_up_proj", linear(c.hidden_size, 2 * c.intermediate_size, c.mlp_bias, device));
  } else {
    gate_proj = register_module("gate_proj",
                                linear(c.hidden_size, c.intermediate_size, c.mlp_bias, device));
    up_proj =
        register_module("up_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias, device));
  }
  down_proj =
      register_module("down_proj", linear(c.intermediate_size, c.hidden_size, c.mlp_bias, device));
}

MLPImpl::MLPImpl(int64_t hidden, int64_t intermediate, bool mixtral_names, c10::Device device) {
  gate_proj = register_module(mixtral_names ? "w1" : "gate_proj",
                              linear(hidden, intermediate, false, device));
  up_proj = register_module(mixtral_names ? "w3" : "up_proj",
                            linear(hidden, intermediate, false, device));
  down_proj = register_module(mixtral_names ? "w2" : "down_proj",
                              linear(intermediate, hidden, false, device));
}

at::Tensor MLPImpl::forward(const at::Tensor& x) {
  if (gate_up_proj) {  // rows: gate, then up
    const auto halves = mdist::nn::call(gate_up_proj, x).chunk(2, -1);
    return mdist::nn::call(down_proj, halves[1] * torch::silu(halves[0]));
  }
  const at::Tensor gate = mdist::nn::call(gate_proj, x);
  const at::Tensor activated = gelu_tanh ? at::gelu(gate, "tanh") : torch::silu(gate);
  return mdist::nn::call(down_proj, activated * mdist::nn::call(up_proj, x));
}

GroupedExpertsImpl::GroupedExpertsImpl(std::vector<MLP> experts_) : experts(std::move(experts_)) {}

at::Tensor GroupedExpertsImpl::forward(const at::Tensor& rows, const at::Tensor& counts,
                                       const at::Tensor& /*tokens*/) {
  const at::Tensor count = counts.to(at::kCPU, at::kLong).contiguous();
  if (count.numel() != static_cast<int64_t>(experts.size())) {
    throw Error("mdist::hf::GroupedExperts: " + std::to_string(count.numel()) + " counts for " +
                std::to_string(experts.size()) + " experts");
  }
  const int64_t* n = count.data_ptr<int64_t>();
  std::vector<at::Tensor> outputs;
  int64_t start = 0;
  for (std::size_t e = 0; e < experts.size(); ++e) {
    if (n[e] == 0) continue;
    outputs.push_back(mdist::nn::call(experts[e], rows.narrow(0, start, n[e])));
    start += n[e];
  }
  // With no row the (empty) result still hangs off the rows' graph.
  return outputs.empty() ? rows.narrow(0, 0, 0) : at::cat(outputs, 0);
}

ExpertsImpl::ExpertsImpl(const LlamaConfig& c, c10::Device device)
    : num_experts(c.moe->num_experts) {
  const MoeConfig& m = *c.moe;
  for (int64_t e = 0; e < m.num_experts; ++e) {
    local.push_back(register_module(
        std::to_string(e), MLP(c.hidden_size, m.moe_intermediate_size, m.mixtral_names, device)));
  }
  grouped = GroupedExperts(local);
}

ExpertsImpl::ExpertsImpl(std::vector<MLP> kept, int64_t first_expert, int64_t total)
    : first(first_expert), num_experts(total) {
  for (std::size_t i = 0; i < kept.size(); ++i) {
    local.push_back(register_module(std::to_string(first + static_cast<int64_t>(i)), kept[i]));
  }
  grouped = GroupedExperts(local);
}

at::Tensor ExpertsImpl::forward(const at::Tensor& tokens, const at::Tensor& chosen,
                                const at::Tensor& weights) {
  // (slot, token) pairs (position slot * N + token) sorted by expert, stably.
  const int64_t n_tokens = tokens.size(0);
  const at::Tensor flat = chosen.t().reshape({-1});
  const at::Tensor order = std::get<1>(flat.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  const at::Tensor token = order.remainder(n_tokens);
  const at::Tensor slot_weight = weights.index({token, order.div(n_tokens, "floor")}).unsqueeze(-1);
  const at::Tensor counts = at::bincount(flat, {}, num_experts).cpu().contiguous();
  const at::Tensor outputs =
      mdist::nn::call(grouped, tokens.index_select(0, token), counts, token);  // `order`'s order
  const int64_t* count = counts.data_ptr<int64_t>();
  at::Tensor out = at::zeros_like(tokens);
  int64_t start = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = count[e];
    if (n == 0) continue;
    const at::Tensor scaled = outputs.narrow(0, start, n) * slot_weight.narrow(0, start, n);
    out = out.index_add(0, token.narrow(0, start, n), scaled.to(out.scalar_type()));
    start += n;
  }
  return out;
}

SparseMoeBlockImpl::SparseMoeBlockImpl(const LlamaConfig& c, c10::Device device)
    : top_k(c.moe->num_experts_per_tok),
      norm_topk_prob(c.moe->norm_topk_prob),
      probabilities_to_logits_dtype(!c.moe->mixtral_names) {
  const MoeConfig& m = *c.moe;
  gate = register_module("gate", linear(c.hidden_size, m.num_experts, false, device));
  experts = register_module("experts", Experts(c, device));
  if (m.shared_expert_intermediate_size > 0) {
    shared_expert = register_module(
        "shared_expert", MLP(c.hidden_size, m.shared_expert_intermediate_size, false, device));
    shared_expert_gate =
        register_module("shared_expert_gate", linear(c.hidden_size, 1, false, device));
  }
}

at::Tensor SparseMoeBlockImpl::forward(const at::Tensor& x) {
  const auto shape = x.sizes().vec();
  const at::Tensor tokens = x.reshape({-1, shape.back()});
  // The router runs in its own dtype: a router kept in fp32 in a bf16 model routes in fp32.
  router_logits = mdist::nn::call(gate, tokens.to(gate->weight.scalar_type()));
  const at::Tensor probabilities = at::softmax(router_logits, -1, at::kFloat);
  auto [weights, chosen] = at::topk(probabilities, top_k, -1);  // torch's tie-breaking
  if (norm_topk_prob) weights = weights / weights.sum(-1, /*keepdim=*/true);
  if (probabilities_to_logits_dtype) weights = weights.to(router_logits.scalar_type());

  at::Tensor out = mdist::nn::call(experts, tokens, chosen, weights);
  if (shared_expert) {
    out = out + torch::sigmoid(mdist::nn::call(shared_expert_gate, tokens)) *
                    mdist::nn::call(shared_expert, tokens);
  }
  return out.view(shape);
}

DecoderLayerImpl::DecoderLayerImpl(const LlamaConfig& c, c10::Device device, int64_t index) {
  self_attn = register_module("self_attn", Attention(c, device));
  if (c.sparse_layer(index)) {
    moe = register_module(c.moe->mixtral_names ? "block_sparse_moe" : "mlp",
                          SparseMoeBlock(c, device));
  } else {
    mlp = register_module("mlp", MLP(c, device));
  }
  if (!c.post_norms) {
    input_layernorm = register_module("input_layernorm", rms_norm(c.hidden_size, c, device));
  }
  post_attention_layernorm =
      register_module("post_attention_layernorm", rms_norm(c.hidden_size, c, device));
  if (c.sandwich_norms) {
    pre_feedforward_layernorm =
        register_module("pre_feedforward_layernorm", rms_norm(c.hidden_size, c, device));
  }
  if (c.post_norms || c.sandwich_norms) {
    post_feedforward_layernorm =
        register_module("post_feedforward_layernorm", rms_norm(c.hidden_size, c, device));
  }
}

at::Tensor DecoderLayerImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                     const at::Tensor& sin, const at::Tensor& mask,
                                     LayerKvCache* cache) {
  if (pre_feedforward_layernorm) {  // Gemma: every sub-layer between two norms
    const at::Tensor attended =
        mdist::nn::call(self_attn, mdist::nn::call(input_layernorm, x), cos, sin, mask, cache);
    const at::Tensor h = x + mdist::nn::call(post_attention_layernorm, attended);
    const at::Tensor normed = mdist::nn::call(pre_feedforward_layernorm, h);
    const at::Tensor out = moe ? mdist::nn::call(moe, normed) : mdist::nn::call(mlp, normed);
    return h + mdist::nn::call(post_feedforward_layernorm, out);
  }
  if (post_feedforward_layernorm) {  // OLMo 2: each sub-layer's output normalised, then added
    const at::Tensor h = x + mdist::nn::call(post_attention_layernorm,
                                             mdist::nn::call(self_attn, x, cos, sin, mask, cache));
    const at::Tensor out = moe ? mdist::nn::call(moe, h) : mdist::nn::call(mlp, h);
    return h + mdist::nn::call(post_feedforward_layernorm, out);
  }
  const at::Tensor h =
      x + mdist::nn::call(self_attn, mdist::nn::call(input_layernorm, x), cos, sin, mask, cache);
  const at::Tensor normed = mdist::nn::call(post_attention_layernorm, h);
  return h + (moe ? mdist::nn::call(moe, normed) : mdist::nn::call(mlp, normed));
}

DecoderModelImpl::DecoderModelImpl(const LlamaConfig& c, c10::Device device)
    : rotary(c), rotary_in_fp32(c.fp32_norm_weight_and_rotary) {
  if (c.sliding_rope_theta) sliding_rotary.emplace(c.sliding_rope_config());
  if (c.scale_embeddings) embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
  auto options = torch::nn::EmbeddingOptions(c.vocab_size, c.hidden_size);
  if (c.pad_token_id) options.padding_idx(*c.pad_token_id);  // as HF: no gradient for it
  embed_tokens = register_module("embed_tokens", embedding(options, device));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    decoder_layers.emplace_back(c, device, i);
    windows.push_back(c.window_of(i));
    sliding_rope_layers.push_back(sliding_rotary && !c.layer_types.empty() &&
                                  c.layer_types.at(static_cast<std::size_t>(i)) ==
                                      LayerType::kSlidingAttention);
    layers->push_back(decoder_layers.back());
  }
  norm = register_module("norm", rms_norm(c.hidden_size, c, device));
}

at::Tensor DecoderModelImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                     const at::Tensor& position_ids, KvCache* cache) {
  if (input_ids.dim() != 2) {
    throw Error("mdist::hf::CausalLM: input_ids must be [batch, seq], got " + shape_of(input_ids));
  }
  const int64_t batch = input_ids.size(0), time = input_ids.size(1);
  const auto device = input_ids.device();
  if (cache != nullptr && cache->layers() != static_cast<int64_t>(decoder_layers.size())) {
    throw Error("mdist::hf::CausalLM: a KvCache of " + std::to_string(cache->layers()) +
                " layers for a model of " + std::to_string(decoder_layers.size()));
  }
  // Positions already cached: the new tokens are keys past .. past + time - 1.
  const int64_t past = cache != nullptr ? cache->length() : 0;
  const int64_t keys = past + time;
  if (attention_mask.defined() && (attention_mask.dim() != 2 || attention_mask.size(0) != batch ||
                                   attention_mask.size(1) != keys)) {
    throw Error("mdist::hf::CausalLM: attention_mask " + shape_of(attention_mask) +
                " does not match input_ids " + shape_of(input_ids) +
                (past > 0 ? " after " + std::to_string(past) + " cached positions" : ""));
  }
  at::Tensor h = mdist::nn::call(embed_tokens, input_ids);
  if (embed_scale) {
    // transformers' 0-dim fp32 buffer, cast to the embeddings' dtype before the product.
    h = h * at::scalar_tensor(*embed_scale, h.options().dtype(at::kFloat)).to(h.scalar_type());
  }

  // Rotary tables [B, T, rotary dim] as transformers' (mdist/hf/rotary.h).
  at::Tensor positions =
      position_ids.defined()
          ? position_ids
          : torch::arange(past, keys, torch::TensorOptions().dtype(at::kLong).device(device));
  if (positions.dim() == 1) positions = positions.unsqueeze(0);
  const auto table_dtype = rotary_in_fp32 ? at::kFloat : h.scalar_type();
  const auto [cos, sin] = rotary.cos_sin(positions.expand({batch, time}), table_dtype);
  at::Tensor sliding_cos, sliding_sin;  // Gemma 3's sliding layers
  if (sliding_rotary) {
    std::tie(sliding_cos, sliding_sin) =
        sliding_rotary->cos_sin(positions.expand({batch, time}), table_dtype);
  }

  // Packed sequences, as transformers' training detects them (masking_utils'
  // find_packed_sequence_indices): with position ids, no attention mask and no cache, a row
  // whose positions do not go up by one from a token to the next holds several documents, a
  // new one starting at each such break. documents [B, T] numbers them within the row; a query
  // then attends only to keys of its own document (a block-diagonal causal mask, windows
  // counted within it). Undefined when no row has a break: plain causal attention.
  at::Tensor documents;
  if (position_ids.defined() && !attention_mask.defined() && cache == nullptr && time > 1) {
    const at::Tensor rows = positions.expand({batch, time});
    documents = rows.diff(1, -1, rows.narrow(1, 0, 1) - 1).ne(1).cumsum(-1);
    if (!documents.select(1, time - 1).ne(0).any().item<bool>()) documents = at::Tensor();
  }

  // The attention mask [B, 1, T, keys] over cache indices for a window (none: full causal):
  // undefined (plain causal) unless padding or the window matters, or queries follow cached
  // keys (scaled_dot_product_attention's is_causal aligns the triangle to the first key, not
  // the last, so it cannot be used then). One new token after cached ones sees every key: no
  // mask is needed for it without padding or a window.
  const bool single_query = past > 0 && time == 1;
  const auto mask_of = [&](std::optional<int64_t> window) {
    at::Tensor mask;
    const bool windowed = window && keys > *window;
    if (!attention_mask.defined() && !documents.defined() && !windowed &&
        (past == 0 || single_query)) {
      return mask;
    }
    const auto long_options = torch::TensorOptions().dtype(at::kLong).device(device);
    const at::Tensor query = torch::arange(past, keys, long_options);
    const at::Tensor key = torch::arange(keys, long_options);
    const at::Tensor distance = query.view({time, 1}) - key.view({1, keys});  // query - key
    at::Tensor allowed = distance >= 0;
    if (windowed) allowed = allowed.logical_and(distance < *window);
    mask = allowed.view({1, 1, time, keys});
    if (attention_mask.defined()) {
      mask = mask.logical_and(attention_mask.to(at::kBool).view({batch, 1, 1, keys}));
    }
    if (documents.defined()) {  // no cache: keys are the queries
      mask = mask.logical_and(documents.unsqueeze(2).eq(documents.unsqueeze(1)).unsqueeze(1));
    }
    mask = mask.expand({batch, 1, time, keys});
    // A query that may attend to no key (a left-padding position) attends to all instead,
    // so that its (unused) output is finite rather than NaN.
    return mask.logical_or(mask.any(-1, /*keepdim=*/true).logical_not());
  };
  // Each layer's window (per layer type): one mask per distinct window, built once.
  std::map<std::optional<int64_t>, at::Tensor> masks;
  for (const auto& window : windows) {
    if (!masks.contains(window)) masks[window] = mask_of(window);
  }

  for (std::size_t i = 0; i < decoder_layers.size(); ++i) {
    const bool local = sliding_rope_layers[i];
    const at::Tensor& layer_cos = local ? sliding_cos : cos;
    const at::Tensor& layer_sin = local ? sliding_sin : sin;
    if (cache == nullptr && i < checkpointed_layers.size() && checkpointed_layers[i]) {
      h = checkpointed_layer(i, h, layer_cos, layer_sin, masks.at(windows[i]));
      continue;
    }
    LayerKvCache* layer_cache = cache != nullptr ? &cache->layer(static_cast<int64_t>(i)) : nullptr;
    h = mdist::nn::call(decoder_layers[i], h, layer_cos, layer_sin, masks.at(windows[i]),
                        layer_cache);
  }
  return mdist::nn::call(norm, h);
}

// The layer's call (its hooks included) under mdist::nn::checkpoint. A sparse layer's router
// logits are a second output, so that the load-balancing loss computed from them after the
// forward gets its gradient through the checkpoint like the hidden states.
at::Tensor DecoderModelImpl::checkpointed_layer(std::size_t i, const at::Tensor& h,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                const at::Tensor& mask) {
  DecoderLayer layer = decoder_layers[i];
  const auto outputs = mdist::nn::checkpoint(
      [layer](const std::vector<at::Tensor>& in) mutable {
        std::vector<at::Tensor> out{mdist::nn::call(layer, in[0], in[1], in[2], in[3], nullptr)};
        if (layer->moe) out.push_back(layer->moe->router_logits);
        return out;
      },
      {h, cos, sin, mask}, {.module = layer.get()});
  if (layer->moe) layer->moe->router_logits = outputs[1];
  return outputs[0];
}

CausalLMImpl::CausalLMImpl(LlamaConfig config_, c10::Device device) : config(std::move(config_)) {
  if (!device.is_cpu() && !device.is_meta()) {
    throw Error("mdist::hf::CausalLM: build it on the CPU or the meta device, not on " +
                device.str() + " (build on the CPU, then ->to(device))");
  }
  model = register_module("model", DecoderModel(config, device));
  if (!config.tie_word_embeddings) {
    lm_head =
        register_module("lm_head", linear(config.hidden_size, config.vocab_size, false, device));
  }
}

at::Tensor CausalLMImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                 const at::Tensor& position_ids, KvCache* cache) {
  return mdist::nn::hooked(*this, &CausalLMImpl::body, input_ids, attention_mask, position_ids,
                           cache);
}

at::Tensor CausalLMImpl::body(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                              const at::Tensor& position_ids, KvCache* cache) {
  const at::Tensor h = mdist::nn::call(model, input_ids, attention_mask, position_ids, cache);
  const at::Tensor logits =
      lm_head ? mdist::nn::call(lm_head, h) : at::linear(h, model->embed_tokens->weight);
  if (!config.final_logit_softcapping) return logits;
  // Gemma 2: tanh(logits / cap) * cap, elementwise (so also on a rank's vocabulary slice).
  const double cap = *config.final_logit_softcapping;
  return at::tanh(logits / cap) * cap;
}

at::Tensor CausalLMImpl::output_weight() const {
  return lm_head ? lm_head->weight : model->embed_tokens->weight;
}

std::vector<at::Tensor> CausalLMImpl::router_logits() const {
  std::vector<at::Tensor> logits;
  for (const auto& layer : model->decoder_layers) {
    if (layer->moe) logits.push_back(layer->moe->router_logits);
  }
  return logits;
}

at::Tensor CausalLMImpl::aux_loss(const at::Tensor& attention_mask) const {
  if (!config.moe) {
    throw Error("mdist::hf::CausalLM::aux_loss: " + config.architecture +
                " is not a mixture of experts");
  }
  return load_balancing_loss(router_logits(), config.moe->num_experts,
                             config.moe->num_experts_per_tok, attention_mask);
}

at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, int64_t num_experts,
                               int64_t top_k, const at::Tensor& attention_mask) {
  if (router_logits.empty()) throw Error("mdist::hf::load_balancing_loss: no router logits");
  const auto device = router_logits.front().device();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor choices = at::zeros({num_experts}, f32);  // top-k choices per expert
  at::Tensor probability = at::zeros({num_experts}, f32);
  at::Tensor rows = at::zeros({}, f32);
  at::Tensor weight;  // [N] 1 for a real token, 0 for padding
  if (attention_mask.defined()) weight = attention_mask.reshape({-1}).to(f32);
  for (const at::Tensor& layer_logits : router_logits) {
    if (layer_logits.dim() != 2 || layer_logits.size(1) != num_experts ||
        (weight.defined() && layer_logits.size(0) != weight.numel())) {
      throw Error("mdist::hf::load_balancing_loss: router logits " + shape_of(layer_logits) +
                  " are not [tokens, " + std::to_string(num_experts) + "]" +
                  (weight.defined()
                       ? " for an attention_mask of " + std::to_string(weight.numel()) + " tokens"
                       : std::string()));
    }
    const at::Tensor p = at::softmax(layer_logits.to(device), -1);  // in the logits' dtype
    const at::Tensor chosen = std::get<1>(at::topk(p, top_k, -1));
    const at::Tensor w = weight.defined() ? weight : at::ones({p.size(0)}, f32);
    choices = choices.index_add(0, chosen.reshape({-1}), w.repeat_interleave(top_k));
    probability = probability + (p.to(at::kFloat) * w.unsqueeze(-1)).sum(0);
    rows = rows + w.sum();
  }
  return at::sum((choices / rows) * (probability / rows)) * static_cast<double>(num_experts);
}

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  if (logits.dim() != 3 || labels.dim() != 2 || logits.size(0) != labels.size(0) ||
      logits.size(1) != labels.size(1)) {
    throw Error("mdist::hf::causal_lm_loss: logits " + shape_of(logits) + " and labels " +
                shape_of(labels) + " are not [B, T, V] and [B, T]");
  }
  const int64_t vocab = logits.size(2);
  const at::Tensor shifted_logits = logits.slice(1, 0, -1).to(at::kFloat).reshape({-1, vocab});
  const at::Tensor shifted_labels =
      labels.slice(1, 1).reshape({-1}).to(at::kLong).to(logits.device());
  return at::cross_entropy_loss(shifted_logits, shifted_labels, {}, at::Reduction::Mean, -100);
}

void load_state_dict(torch::nn::Module& model, const std::map<std::string, at::Tensor>& tensors) {
  auto params = model.named_parameters(/*recurse=*/true);
  std::vector<std::string> missing, unexpected, mismatched;
  for (const auto& item : params) {
    const auto it = tensors.find(item.key());
    if (it == tensors.end()) {
      missing.push_back(item.key());
    } else if (it->second.sizes() != item.value().sizes()) {
      mismatched.push_back(item.key() + " (checkpoint " + shape_of(it->second) + ", model " +
                           shape_of(item.value()) + ")");
    }
  }
  const at::Tensor* embed = params.find("model.embed_tokens.weight");
  for (const auto& [name, tensor] : tensors) {
    if (params.contains(name)) continue;
    // A tied model's lm_head.weight is embed_tokens.weight: accept a listed copy, ignore it.
    if (name == "lm_head.weight" && embed != nullptr && tensor.sizes() == embed->sizes()) continue;
    unexpected.push_back(name);
  }
  if (!missing.empty() || !unexpected.empty() || !mismatched.empty()) {
    std::string message = "mdist::hf::load_state_dict:";
    if (!missing.empty()) message += " missing keys: " + join(missing) + ";";
    if (!unexpected.empty()) message += " unexpected keys: " + join(unexpected) + ";";
    if (!mismatched.empty()) message += " shape mismatch: " + join(mismatched) + ";";
    message.pop_back();
    throw Error(message);
  }
  const at::NoGradGuard no_grad;
  for (auto& item : params) {
    // A copy into a meta tensor does nothing, silently.
    if (item.value().is_meta()) {
      throw Error("mdist::hf::load_state_dict: '" + item.key() +
                  "' is on the meta device and has no storage to load into (fsdp2_wrap the "
                  "model and use load_checkpoint_sharded, or mdist::nn::to_empty it first)");
    }
  }
  for (auto& item : params) item.value().copy_(tensors.at(item.key()));
}

void load_state_dict(CausalLM& model, const std::map<std::string, at::Tensor>& tensors) {
  if (!model->config.moe) return load_state_dict(*model, tensors);
  load_state_dict(*model, unfuse_experts(model->config, tensors));
}

std::vector<ExpertSlice> expert_slices(const LlamaConfig& config, const std::string& key,
                                       c10::IntArrayRef shape) {
  if (!config.moe) return {};
  const MoeConfig& m = *config.moe;
  const int64_t experts = m.num_experts, inter = m.moe_intermediate_size;
  const int64_t hidden = config.hidden_size;
  // transformers 5 names Mixtral's block "mlp"; the published checkpoints "block_sparse_moe".
  const auto block = [&](const std::string& prefix) {
    if (!m.mixtral_names || !prefix.ends_with(".mlp")) return prefix;
    return prefix.substr(0, prefix.size() - 4) + ".block_sparse_moe";
  };
  const auto expert_key = [&](const std::string& prefix, int64_t e, int which) {
    static constexpr const char* kQwen[] = {"gate_proj", "up_proj", "down_proj"};
    static constexpr const char* kMixtral[] = {"w1", "w3", "w2"};
    return block(prefix) + ".experts." + std::to_string(e) + "." +
           (m.mixtral_names ? kMixtral : kQwen)[which] + ".weight";
  };
  const auto check = [&](std::vector<int64_t> expected) {
    if (shape != c10::IntArrayRef(expected)) {
      throw Error("mdist::hf: '" + key + "' is " + shape_of(at::empty(shape, c10::kMeta)) +
                  ", but " + config.architecture + " with these experts needs " +
                  shape_of(at::empty(expected, c10::kMeta)));
    }
  };
  constexpr std::string_view kGateUp = ".experts.gate_up_proj", kDown = ".experts.down_proj",
                             kRouter = ".mlp.gate.weight";
  std::vector<ExpertSlice> slices;
  if (key.ends_with(kGateUp)) {
    check({experts, 2 * inter, hidden});
    const std::string prefix = key.substr(0, key.size() - kGateUp.size());
    for (int64_t e = 0; e < experts; ++e) {
      slices.push_back({expert_key(prefix, e, 0), e, 0, inter});  // gate first, as transformers
      slices.push_back({expert_key(prefix, e, 1), e, inter, inter});
    }
  } else if (key.ends_with(kDown)) {
    check({experts, hidden, inter});
    const std::string prefix = key.substr(0, key.size() - kDown.size());
    for (int64_t e = 0; e < experts; ++e)
      slices.push_back({expert_key(prefix, e, 2), e, 0, hidden});
  } else if (m.mixtral_names && key.ends_with(kRouter)) {
    slices.push_back({block(key.substr(0, key.size() - kRouter.size() + 4)) + ".gate.weight", -1, 0,
                      shape.empty() ? 0 : shape[0]});
  }
  return slices;
}

std::map<std::string, at::Tensor> unfuse_experts(const LlamaConfig& config,
                                                 std::map<std::string, at::Tensor> tensors) {
  if (!config.moe) return tensors;
  std::map<std::string, at::Tensor> out;
  for (auto& [key, t] : tensors) {
    const auto slices = expert_slices(config, key, t.sizes());
    if (slices.empty()) out[key] = t;
    for (const auto& s : slices) {
      out[s.name] = s.expert < 0 ? t : t[s.expert].slice(0, s.first_row, s.first_row + s.rows);
    }
  }
  return out;
}

}  // namespace mdist::hf
