// See mdist/train/sequences.h.
#include "mdist/train/sequences.h"

#include <algorithm>

namespace mdist::train {
namespace {

at::Tensor to_device(const at::Tensor& t, const c10::Device& device) {
  return t.defined() ? t.to(device) : t;
}

at::Tensor narrowed(const at::Tensor& t, std::int64_t first, std::int64_t count) {
  return t.defined() ? t.narrow(0, first, count) : t;
}

}  // namespace

Batch Batch::to(const c10::Device& device) const {
  return {to_device(ids, device), to_device(labels, device), to_device(attention_mask, device),
          to_device(position_ids, device)};
}

Batch Batch::narrow(std::int64_t first, std::int64_t count) const {
  return {narrowed(ids, first, count), narrowed(labels, first, count),
          narrowed(attention_mask, first, count), narrowed(position_ids, first, count)};
}

std::vector<Batch> Batch::split(std::int64_t size) const {
  std::vector<Batch> parts;
  for (std::int64_t first = 0; first < this->size(); first += size) {
    parts.push_back(narrow(first, std::min(size, this->size() - first)));
  }
  return parts;
}

std::int64_t predicted_tokens(const Batch& batch) {
  const std::int64_t T = batch.ids.size(1);
  if (T < 2) return 0;
  // Each position but the last predicts the next token.
  if (!batch.labels.defined()) return batch.ids.size(0) * (T - 1);
  return batch.labels.narrow(1, 1, T - 1).ne(-100).sum().item<std::int64_t>();
}

}  // namespace mdist::train
