#pragma once
// A small stack of pre-norm transformer blocks (causal self-attention + GELU MLP) over token
// embeddings. Blocks call their layers through mdist::nn::call and the model calls its
// blocks the same way, so each block can be a fully_shard unit of its own.
#include <torch/torch.h>

#include "mdist/nn/hooks.h"

namespace mdist::testing {

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t dim, int64_t heads, int64_t hidden) : heads_(heads) {
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    // No qkv bias, as in Llama: the key bias has a zero gradient in exact arithmetic, and
    // AdamW would turn its rounding noise into full-size updates.
    qkv = register_module("qkv",
                          torch::nn::Linear(torch::nn::LinearOptions(dim, 3 * dim).bias(false)));
    proj = register_module("proj", torch::nn::Linear(dim, dim));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    up = register_module("up", torch::nn::Linear(dim, hidden));
    down = register_module("down", torch::nn::Linear(hidden, dim));
  }
  at::Tensor forward(const at::Tensor& x) { return mdist::nn::hooked(*this, &BlockImpl::body, x); }
  at::Tensor body(const at::Tensor& x) {
    const int64_t batch = x.size(0), time = x.size(1), dim = x.size(2);
    const at::Tensor qkv_out = mdist::nn::call(qkv, mdist::nn::call(norm1, x))
                                   .view({batch, time, 3, heads_, dim / heads_})
                                   .permute({2, 0, 3, 1, 4});
    const at::Tensor attention =
        at::scaled_dot_product_attention(qkv_out[0], qkv_out[1], qkv_out[2], {}, 0.0, true)
            .transpose(1, 2)
            .reshape({batch, time, dim});
    const at::Tensor h = x + mdist::nn::call(proj, attention);
    return h + mdist::nn::call(down, torch::gelu(mdist::nn::call(up, mdist::nn::call(norm2, h))));
  }
  int64_t heads_;
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, up{nullptr}, down{nullptr};
};
TORCH_MODULE(Block);

struct TinyTransformerImpl : torch::nn::Module {
  static constexpr int64_t kVocab = 32, kDim = 16, kHeads = 2, kHidden = 40, kLayers = 3;
  TinyTransformerImpl() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kDim));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < kLayers; ++i) layers->push_back(Block(kDim, kHeads, kHidden));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  // Token ids [batch, time] -> logits [batch, time, vocab].
  at::Tensor forward(const at::Tensor& ids) {
    return mdist::nn::hooked(*this, &TinyTransformerImpl::body, ids);
  }
  at::Tensor body(const at::Tensor& ids) {
    at::Tensor h = mdist::nn::call(embed, ids);
    for (const auto& layer : *layers) {
      auto block = std::dynamic_pointer_cast<BlockImpl>(layer);
      h = mdist::nn::call(block, h);
    }
    return mdist::nn::call(head, mdist::nn::call(norm, h));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList layers{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TinyTransformer);

}  // namespace mdist::testing
