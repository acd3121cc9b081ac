#pragma once
// The data the trainer and the held-out evaluation read: a set of equal-length token sequences
// addressed by index, each with what its positions are trained on. The caller adapts its own
// data (mdist train: the windows of a token file, in its seeded epoch order) so that the
// library stays free of file formats.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mdist::train {

// Sequences for one forward, in Hugging Face's conventions: the model reads `ids`, and the
// token at position t + 1 of `labels` is what position t predicts.
struct Batch {
  at::Tensor ids;  // [B, T] int64
  // Undefined: `ids` (language modelling: every next token is predicted). Else [B, T] int64,
  // -100 where no loss is taken (a prompt, padding), as transformers' labels.
  at::Tensor labels{};
  // Undefined: every token is real. Else [B, T] of 0/1, 0 at padding after a sequence's end
  // (right padding: the causal mask already keeps real tokens from seeing it; a mixture of
  // experts' load-balancing loss leaves it out, as transformers' does with the mask).
  at::Tensor attention_mask{};
  // Undefined: positions 0..T-1 in every row. Else [B, T] int64: packed sequences (several
  // documents per row), each document's positions restarting at 0; the model then masks
  // attention per document (hf::DecoderModelImpl::forward, as transformers' packed training),
  // and `attention_mask` stays undefined.
  at::Tensor position_ids{};

  // The labels the loss takes: `labels`, or `ids` when there are none.
  const at::Tensor& targets() const { return labels.defined() ? labels : ids; }
  std::int64_t size() const { return ids.size(0); }
  Batch to(const c10::Device& device) const;
  // Consecutive sequences [first, first + count).
  Batch narrow(std::int64_t first, std::int64_t count) const;
  // Into parts of `size` sequences (the last one shorter when size does not divide B).
  std::vector<Batch> split(std::int64_t size) const;
};

// The next-token predictions of `batch` that count in a loss: every position but each
// sequence's last whose next label is not -100.
std::int64_t predicted_tokens(const Batch& batch);

struct SequenceSource {
  std::int64_t count = 0;   // sequences; a training source is read past it (next epochs)
  std::int64_t length = 0;  // tokens per sequence
  // The sequences `which` ([which.size(), length] tensors on the CPU). A training source is
  // addressed by position in the run's stream (0, 1, 2, ... over every epoch), which it maps
  // to its own order.
  std::function<Batch(const std::vector<std::int64_t>& which)> rows;
  std::string description;  // for logs and metrics
};

}  // namespace mdist::train
