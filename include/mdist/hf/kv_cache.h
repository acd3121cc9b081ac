#pragma once
// The key/value cache of incremental decoding (transformers' DynamicCache): per decoder layer,
// the keys and values of every position seen so far, so that generation runs each new token
// through the model once instead of the whole sequence again.
//
// The caller owns a KvCache and passes it to CausalLM::forward (mdist/hf/causal_lm.h): the
// first call (prefill) takes the prompts, each later call the new token(s). What is stored is
// what transformers stores: keys after RoPE (and after Qwen3's k_norm) and values, both
// [batch, kv_heads, length, head_dim] before the grouped-query repeat, so a cache holds
// num_key_value_heads heads, not num_attention_heads. Under tensor parallelism each rank's
// attention holds its own heads and so its cache holds those only; nothing is communicated.
//
// Positions continue from length(): a forward with a cache and no position_ids numbers its
// tokens length() .. length() + T - 1 (transformers' cache_position). The attention mask given
// with a cache covers the cached positions and the new ones ([B, length() + T]), as the mask
// transformers' generate extends by one column per step. Left-padded batches take position ids
// counted from each row's first real token (generation_position_ids below).
//
// Sliding-window layers: every position is kept and the window is applied by the mask (a query
// at cache index i sees keys j with i - j < window), which is the attention transformers
// computes from its sliding cache (that cache drops what the window excludes; keys a mask
// excludes get weight exactly zero). Memory therefore grows with the sequence, not the window.
//
// Storage grows by doubling (a new step copies only its own keys into spare capacity), so the
// cost of a step does not grow with a copy of the whole cache.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace mdist::hf {

// One decoder layer's cached keys and values.
class LayerKvCache {
 public:
  // Keys and values cached so far.
  int64_t length() const { return length_; }
  // Appends this step's keys and values [B, H_kv, T, D] and returns the layer's whole keys and
  // values [B, H_kv, length() + T, D] (views into the cache, valid until the next append).
  // Throws mdist::Error when B, H_kv, D, dtype or device differ from what is cached.
  std::pair<at::Tensor, at::Tensor> append(const at::Tensor& keys, const at::Tensor& values);

 private:
  at::Tensor keys_, values_;  // [B, H_kv, capacity, D]; positions [0, length_) are real
  int64_t length_ = 0;
};

class KvCache {
 public:
  // An empty cache for a model of `layers` decoder layers.
  explicit KvCache(int64_t layers);
  // Positions cached (of the first layer; every layer has the same after a forward).
  int64_t length() const;
  int64_t layers() const { return static_cast<int64_t>(layers_.size()); }
  LayerKvCache& layer(int64_t index);
  // Forgets everything (the next forward is a prefill again).
  void clear();

 private:
  std::vector<LayerKvCache> layers_;
};

// The position ids of the last `new_tokens` columns of a left-padded batch's attention mask
// [B, L] (1: a real token): each real token's index among its row's real tokens, padding 1
// (as transformers' generate; padding positions are masked, their value never matters).
// Returns int64 [B, new_tokens].
at::Tensor generation_position_ids(const at::Tensor& attention_mask, int64_t new_tokens);

}  // namespace mdist::hf
