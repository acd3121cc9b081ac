#pragma once
// A small causal LM with Hugging Face's module layout, model.{embed_tokens, layers, norm} and
// lm_head, built from tiny_transformer.h's blocks: the layout fsdp2_wrap detects, without the
// HF layer's config and checkpoint machinery.
#include <torch/torch.h>

#include "mdist/nn/hooks.h"
#include "tests/fsdp/tiny_transformer.h"

namespace mdist::testing {

struct HfShapedInnerImpl : torch::nn::Module {
  HfShapedInnerImpl() {
    embed_tokens = register_module("embed_tokens", torch::nn::Embedding(32, 8));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) layers->push_back(Block(8, 2, 16));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
  }
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(HfShapedInner);

// Vocabulary 32, hidden 8, 3 blocks; forward(ids) gives logits.
struct HfShapedLmImpl : torch::nn::Module {
  HfShapedLmImpl() {
    model = register_module("model", HfShapedInner());
    lm_head = register_module("lm_head", torch::nn::Linear(8, 32));
  }
  at::Tensor forward(const at::Tensor& ids) {
    return mdist::nn::hooked(*this, &HfShapedLmImpl::body, ids);
  }
  at::Tensor body(const at::Tensor& ids) {
    at::Tensor h = mdist::nn::call(model->embed_tokens, ids);
    for (const auto& layer : *model->layers) {
      auto block = std::dynamic_pointer_cast<BlockImpl>(layer);
      h = mdist::nn::call(block, h);
    }
    return mdist::nn::call(lm_head, mdist::nn::call(model->norm, h));
  }
  HfShapedInner model{nullptr};
  torch::nn::Linear lm_head{nullptr};
};
TORCH_MODULE(HfShapedLm);

}  // namespace mdist::testing
