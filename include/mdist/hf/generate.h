#pragma once
// Generation with a KV cache (transformers' model.generate for a decoder-only model): the
// prompts batched and left-padded, one prefill forward over them, then one forward of one
// token per row per step, each reading and extending a KvCache (mdist/hf/kv_cache.h).
//
// As transformers: the attention mask of a padded batch grows by one column of ones per step
// and position ids count from each row's first real token; a row that produced an end-of-
// sequence token is finished (its later inputs are a filler token whose outputs are dropped),
// and generation stops when every row is finished or after max_new_tokens. Choosing a token:
// greedy (argmax, the first of equal maxima as torch.argmax) or sampling from the softmax of
// logits / temperature, restricted to the top_k likeliest (ties at the k-th kept) and then to
// the smallest set whose probability reaches top_p (transformers' TopK and TopP warpers, in
// that order), with a seeded CPU generator.
//
// Distributed use: every rank of a tensor-parallel group runs generate() together (each
// forward is collective); `full_logits` gathers a split vocabulary, and `share` makes every
// rank continue with the same tokens (rank 0's, broadcast), so the output does not depend on
// the rank count. Both default to the identity for a single process.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "mdist/hf/causal_lm.h"

namespace mdist::hf {

struct GenerationOptions {
  int64_t max_new_tokens = 32;
  bool greedy = true;  // else sample with temperature, top_k, top_p and seed
  double temperature = 1.0;
  int64_t top_k = 0;   // 0: no limit
  double top_p = 1.0;  // 1: no limit
  std::uint64_t seed = 0;
  std::vector<int64_t> eos_token_ids;  // none: run for max_new_tokens
  // The input of a left-padding position and of a finished row (never attended to).
  int64_t pad_token_id = 0;
  // Logits [B, V_local] of this rank -> [B, V]; identity when empty.
  std::function<at::Tensor(const at::Tensor&)> full_logits;
  // This rank's choices -> the choices every rank continues with; identity when empty.
  std::function<std::vector<int64_t>(const std::vector<int64_t>&)> share;
  // Called after each step with the new token of every row (a finished row's is not
  // reported: `finished[row]` was true before the step).
  std::function<void(const std::vector<int64_t>& tokens, const std::vector<bool>& finished)>
      on_step;
};

// The new tokens of each prompt (ending with its end-of-sequence token when one came).
// Throws mdist::Error for no prompts, an empty prompt, bad options, or prompts whose length
// plus max_new_tokens exceeds the model's max_position_embeddings.
std::vector<std::vector<int64_t>> generate(CausalLM& model,
                                           const std::vector<std::vector<int64_t>>& prompts,
                                           const GenerationOptions& options);

// The end-of-sequence ids of a config.json (eos_token_id: a number, a list, or absent).
std::vector<int64_t> eos_token_ids(const LlamaConfig& config);

// Logits [B, V] (fp32) -> the next token of each row by `options` (greedy or sampled with
// `generator`, a CPU generator).
at::Tensor choose_tokens(const at::Tensor& logits, const GenerationOptions& options,
                         at::Generator& generator);

}  // namespace mdist::hf
