#pragma once
// A Llama-shaped decoder stack for the FSDP training benchmark (not a library model: the
// Hugging Face family comes later). Parameter names, shapes, initialisation and data match
// bench/llama_stack.py, so that mdist's fully_shard and PyTorch's train the same thing.
//
// Every module calls its submodules through mdist::nn::call and the root, which the training
// loop calls directly, routes its own forward through mdist::nn::hooked, so the root and each
// decoder layer (any submodule, in fact) can be a fully_shard unit.
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mdist/nn/hooks.h"

namespace mdist::bench {

struct LlamaConfig {
  static constexpr int64_t kVocab = 256;  // byte-level
  static constexpr int64_t kDim = 512;
  static constexpr int64_t kLayers = 8;
  static constexpr int64_t kHeads = 8;
  static constexpr int64_t kHeadDim = kDim / kHeads;
  static constexpr int64_t kIntermediate = 1536;
  static constexpr double kNormEps = 1e-5;
  static constexpr double kRopeTheta = 10000.0;
};

inline torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

struct RMSNormImpl : torch::nn::Module {
  explicit RMSNormImpl(int64_t dim) : dim_(dim) {
    weight = register_parameter("weight", torch::ones({dim}));
  }
  at::Tensor forward(const at::Tensor& x) {
    return at::rms_norm(x, {dim_}, weight, LlamaConfig::kNormEps);
  }
  int64_t dim_;
  at::Tensor weight;
};
TORCH_MODULE(RMSNorm);

// cos and sin [seq_len, head_dim] of the rotate-half formulation; computed with the same ops
// as the Python side so that both see the same bits.
inline std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t seq_len, int64_t head_dim) {
  const at::Tensor exponents =
      torch::arange(0, head_dim, 2, torch::kFloat32) / static_cast<double>(head_dim);
  const at::Tensor inv_freq = at::pow(LlamaConfig::kRopeTheta, exponents).reciprocal();
  const at::Tensor freqs = at::outer(torch::arange(seq_len, torch::kFloat32), inv_freq);
  const at::Tensor angles = at::cat({freqs, freqs}, -1);
  return {angles.cos(), angles.sin()};
}

inline at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

struct AttentionImpl : torch::nn::Module {
  AttentionImpl() {
    using C = LlamaConfig;
    q_proj = register_module("q_proj", linear(C::kDim, C::kDim));
    k_proj = register_module("k_proj", linear(C::kDim, C::kDim));
    v_proj = register_module("v_proj", linear(C::kDim, C::kDim));
    o_proj = register_module("o_proj", linear(C::kDim, C::kDim));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    using C = LlamaConfig;
    const int64_t batch = x.size(0), time = x.size(1);
    const auto heads = [&](const at::Tensor& t) {
      return t.view({batch, time, C::kHeads, C::kHeadDim}).transpose(1, 2);
    };
    const at::Tensor q = heads(mdist::nn::call(q_proj, x));
    const at::Tensor k = heads(mdist::nn::call(k_proj, x));
    const at::Tensor v = heads(mdist::nn::call(v_proj, x));
    const at::Tensor q_rot = q * cos + rotate_half(q) * sin;
    const at::Tensor k_rot = k * cos + rotate_half(k) * sin;
    const at::Tensor out = at::scaled_dot_product_attention(q_rot, k_rot, v, {}, 0.0, true);
    return mdist::nn::call(o_proj, out.transpose(1, 2).reshape({batch, time, C::kDim}));
  }
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};
TORCH_MODULE(Attention);

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    using C = LlamaConfig;
    gate_proj = register_module("gate_proj", linear(C::kDim, C::kIntermediate));
    up_proj = register_module("up_proj", linear(C::kDim, C::kIntermediate));
    down_proj = register_module("down_proj", linear(C::kIntermediate, C::kDim));
  }
  at::Tensor forward(const at::Tensor& x) {  // SwiGLU
    return mdist::nn::call(
        down_proj, torch::silu(mdist::nn::call(gate_proj, x)) * mdist::nn::call(up_proj, x));
  }
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(Mlp);

struct DecoderLayerImpl : torch::nn::Module {
  DecoderLayerImpl() {
    input_layernorm = register_module("input_layernorm", RMSNorm(LlamaConfig::kDim));
    self_attn = register_module("self_attn", Attention());
    post_attention_layernorm =
        register_module("post_attention_layernorm", RMSNorm(LlamaConfig::kDim));
    mlp = register_module("mlp", Mlp());
  }
  // Not routed through hooked: the root calls layers through mdist::nn::call, which already
  // runs their hooks (hooked as well would run fully_shard's hooks twice per call).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    const at::Tensor h =
        x + mdist::nn::call(self_attn, mdist::nn::call(input_layernorm, x), cos, sin);
    return h + mdist::nn::call(mlp, mdist::nn::call(post_attention_layernorm, h));
  }
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Attention self_attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(DecoderLayer);

struct LlamaStackImpl : torch::nn::Module {
  LlamaStackImpl() {
    using C = LlamaConfig;
    embed_tokens = register_module("embed_tokens", torch::nn::Embedding(C::kVocab, C::kDim));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < C::kLayers; ++i) {
      decoder_layers.push_back(std::make_shared<DecoderLayerImpl>());
      layers->push_back(decoder_layers.back());
    }
    norm = register_module("norm", RMSNorm(C::kDim));
    lm_head = register_module("lm_head", linear(C::kDim, C::kVocab));  // untied
  }
  // Token ids [batch, time] -> logits [batch, time, vocab].
  at::Tensor forward(const at::Tensor& ids) {
    return mdist::nn::hooked(*this, &LlamaStackImpl::body, ids);
  }
  at::Tensor body(const at::Tensor& ids) {
    auto [cos, sin] = rotary_tables(ids.size(1), LlamaConfig::kHeadDim);
    at::Tensor h = mdist::nn::call(embed_tokens, ids);
    // In the activations' dtype, as transformers' rotary embedding returns them (a bf16 model
    // run without fully_shard's input casts, fsdp_train's compute-only mode, needs it).
    cos = cos.to(h.scalar_type());
    sin = sin.to(h.scalar_type());
    for (auto& layer : decoder_layers) h = mdist::nn::call(layer, h, cos, sin);
    return mdist::nn::call(lm_head, mdist::nn::call(norm, h));
  }
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  std::vector<std::shared_ptr<DecoderLayerImpl>> decoder_layers;  // layers, typed
  RMSNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};
};
TORCH_MODULE(LlamaStack);

// Deterministic and identical to the Python side (same torch CPU generator): parameter i in
// name order is drawn after manual_seed(1000 + i); norm weights are ones.
inline void init_weights(torch::nn::Module& model) {
  auto named = model.named_parameters().pairs();
  std::sort(named.begin(), named.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  const at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < named.size(); ++i) {
    const auto& [name, param] = named[i];
    if (name.ends_with("norm.weight")) {
      param.fill_(1.0);
    } else {
      torch::manual_seed(1000 + i);
      param.normal_(0.0, 0.02);
    }
  }
}

// Inputs and targets [count, seq_len] of sequences [first_seq, first_seq + count) of the
// global batch of `step`. Each sequence is a Fibonacci stream mod 256 (learnable from the two
// previous tokens) started from two bytes of (step, sequence): no RNG, so both sides agree.
struct TokenBatch {
  at::Tensor inputs, targets;
};
inline TokenBatch batch_tokens(int64_t step, int64_t first_seq, int64_t count, int64_t seq_len) {
  at::Tensor tokens = torch::empty({count, seq_len + 1}, torch::kInt64);
  auto rows = tokens.accessor<int64_t, 2>();
  for (int64_t r = 0; r < count; ++r) {
    const int64_t seq = first_seq + r;
    rows[r][0] = (step * 31 + seq * 17) % 256;
    rows[r][1] = (step * 7 + seq * 13 + 1) % 256;
    for (int64_t i = 2; i <= seq_len; ++i) rows[r][i] = (rows[r][i - 1] + rows[r][i - 2]) % 256;
  }
  return {tokens.slice(1, 0, seq_len), tokens.slice(1, 1, seq_len + 1)};
}

}  // namespace mdist::bench
