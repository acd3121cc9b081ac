// mdist::hf::KvCache: per-layer keys and values for incremental decoding.
#include "mdist/hf/kv_cache.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>
#include <string>

#include "mdist/error.h"

namespace mdist::hf {
namespace {

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

}  // namespace

std::pair<at::Tensor, at::Tensor> LayerKvCache::append(const at::Tensor& keys,
                                                       const at::Tensor& values) {
  if (keys.dim() != 4 || keys.sizes() != values.sizes()) {
    throw Error("mdist::hf::KvCache: keys " + shape_of(keys) + " and values " + shape_of(values) +
                " are not both [batch, kv_heads, time, head_dim]");
  }
  const int64_t batch = keys.size(0), heads = keys.size(1), time = keys.size(2), dim = keys.size(3);
  if (keys_.defined() &&
      (keys_.size(0) != batch || keys_.size(1) != heads || keys_.size(3) != dim ||
       keys_.scalar_type() != keys.scalar_type() || keys_.device() != keys.device())) {
    throw Error("mdist::hf::KvCache: keys " + shape_of(keys) + " do not continue the cache of " +
                shape_of(keys_.narrow(2, 0, length_)) + " (clear() it for another batch)");
  }
  const int64_t needed = length_ + time;
  const int64_t capacity = keys_.defined() ? keys_.size(2) : 0;
  if (needed > capacity) {
    // Doubling keeps the copies of a growing cache to O(length) over the whole generation.
    const int64_t grown = std::max<int64_t>(needed, 2 * capacity);
    at::Tensor k = at::empty({batch, heads, grown, dim}, keys.options());
    at::Tensor v = at::empty({batch, heads, grown, dim}, values.options());
    if (length_ > 0) {
      k.narrow(2, 0, length_).copy_(keys_.narrow(2, 0, length_));
      v.narrow(2, 0, length_).copy_(values_.narrow(2, 0, length_));
    }
    keys_ = std::move(k);
    values_ = std::move(v);
  }
  keys_.narrow(2, length_, time).copy_(keys);
  values_.narrow(2, length_, time).copy_(values);
  length_ = needed;
  return {keys_.narrow(2, 0, length_), values_.narrow(2, 0, length_)};
}

KvCache::KvCache(int64_t layers) {
  if (layers < 0) throw Error("mdist::hf::KvCache: negative layer count");
  layers_.resize(static_cast<std::size_t>(layers));
}

int64_t KvCache::length() const { return layers_.empty() ? 0 : layers_.front().length(); }

LayerKvCache& KvCache::layer(int64_t index) {
  if (index < 0 || index >= layers()) {
    throw Error("mdist::hf::KvCache: layer " + std::to_string(index) + " of a cache of " +
                std::to_string(layers()) + " layers");
  }
  return layers_[static_cast<std::size_t>(index)];
}

void KvCache::clear() {
  for (auto& layer : layers_) layer = LayerKvCache();
}

at::Tensor generation_position_ids(const at::Tensor& attention_mask, int64_t new_tokens) {
  if (attention_mask.dim() != 2 || new_tokens < 0 || new_tokens > attention_mask.size(1)) {
    throw Error("mdist::hf::generation_position_ids: mask " + shape_of(attention_mask) +
                " has no last " + std::to_string(new_tokens) + " columns");
  }
  const at::Tensor real = attention_mask.to(at::kLong);
  const at::Tensor positions = (real.cumsum(-1) - 1).masked_fill(real == 0, 1);
  return positions.narrow(1, real.size(1) - new_tokens, new_tokens);
}

}  // namespace mdist::hf
