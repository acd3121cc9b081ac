#pragma once
// Rotary position embeddings (RoPE) as transformers 5.24 computes them, for every kind of its
// ROPE_INIT_FUNCTIONS that mdist supports: default, linear, dynamic (NTK, recomputed when the
// positions outgrow max_position_embeddings), yarn, longrope (short / long factors) and llama3,
// with partial_rotary_factor (only the first channels of a head rotate) and the attention
// scaling that yarn and longrope multiply cos and sin by.
//
// The numbers are transformers': the same operations in the same order and dtypes (fp32
// tensors; the scalar parts in double, as Python computes them), so the tables are equal, not
// merely close.
#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <utility>

#include "mdist/hf/config.h"

namespace mdist::hf {

// The inverse frequencies [ceil(rotary_dim / 2)] (fp32, CPU) and the factor cos and sin are
// multiplied by. `seq_len`: the number of positions the forward covers (max position + 1),
// which dynamic and longrope depend on; none: as at construction (dynamic: plain RoPE up to
// max_position_embeddings; longrope: the short factors).
struct RopeFrequencies {
  at::Tensor inv_freq;
  double attention_scaling = 1.0;
};
RopeFrequencies rope_frequencies(const LlamaConfig& config,
                                 std::optional<int64_t> seq_len = std::nullopt);

// The channels of a head that rotate: int(head_dim * partial_rotary_factor).
int64_t rotary_dim(const LlamaConfig& config);

// rope_frequencies(config).inv_freq.
at::Tensor rope_inv_freq(const LlamaConfig& config);

// The rotary tables of a model, with the state transformers' dynamic_rope_update keeps between
// forwards: dynamic RoPE recomputes inv_freq when a forward's positions exceed those it has
// seen (and goes back to the original one when they fall below max_position_embeddings
// again); longrope switches to the long factors while they exceed
// original_max_position_embeddings. The state is this object's (one per model), as in
// transformers, where it is the rotary module's.
class RotaryEmbedding {
 public:
  explicit RotaryEmbedding(const LlamaConfig& config);

  // cos and sin [B, T, 2 * inv_freq.size(0)] in `dtype` for int64 positions [B, T] (any
  // device; the tables are computed in fp32 there). Updates the dynamic / longrope state.
  std::pair<at::Tensor, at::Tensor> cos_sin(const at::Tensor& positions, at::ScalarType dtype);

  // The inverse frequencies the last forward used (at first: those at construction).
  const at::Tensor& inv_freq() const { return inv_freq_; }
  double attention_scaling() const { return attention_scaling_; }

 private:
  void update(int64_t seq_len);

  LlamaConfig config_;
  at::Tensor inv_freq_;
  at::Tensor original_inv_freq_;
  at::Tensor long_inv_freq_;  // longrope, computed on first use
  double attention_scaling_ = 1.0;
  int64_t max_seq_len_cached_ = 0;  // dynamic
};

// q or k [B, H, T, head_dim] rotated by cos, sin [B, T, R] (R <= head_dim): rotate-half on the
// first R channels, the others passed through (transformers' partial rotary; all channels when
// R == head_dim).
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace mdist::hf
