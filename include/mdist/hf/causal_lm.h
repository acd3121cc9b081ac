#pragma once
// The Hugging Face Llama-family causal LM (LlamaForCausalLM, MistralForCausalLM,
// Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, Olmo2ForCausalLM, Gemma2ForCausalLM,
// Gemma3ForCausalLM (text), and the mixtures of experts Qwen3MoeForCausalLM, Qwen2MoeForCausalLM
// and MixtralForCausalLM) as a libtorch module whose parameter names are the keys of the published
// checkpoints, so a checkpoint loads by name with no mapping table:
//
//   model.embed_tokens.weight
//   model.layers.N.self_attn.{q,k,v,o}_proj.{weight,bias}     bias per LlamaConfig
//   model.layers.N.self_attn.qkv_proj.weight                  Phi-3: q, k, v fused (rows)
//   model.layers.N.self_attn.{q,k}_norm.weight                Qwen3, Qwen3-MoE, Gemma 3 (one head
//                                                               wide), OLMo 2 (whole projection)
//   model.layers.N.mlp.{gate,up,down}_proj.weight              dense layers
//   model.layers.N.mlp.gate_up_proj.weight                     Phi-3: gate, up fused (rows)
//   model.layers.N.mlp.gate.weight                             Qwen3-MoE sparse layers: router
//   model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight      and experts
//   model.layers.N.mlp.shared_expert.{gate,up,down}_proj.weight Qwen2-MoE: shared expert
//   model.layers.N.mlp.shared_expert_gate.weight                 and its gate [1, hidden]
//   model.layers.N.block_sparse_moe.gate.weight                Mixtral: router
//   model.layers.N.block_sparse_moe.experts.E.w{1,3,2}.weight    and experts (gate, up, down)
//   model.layers.N.{input,post_attention}_layernorm.weight
//   model.layers.N.post_feedforward_layernorm.weight          OLMo 2 (which has no input norm),
//                                                               Gemma 2 / 3
//   model.layers.N.pre_feedforward_layernorm.weight           Gemma 2 / 3
//   model.norm.weight
//   lm_head.weight                                            absent when tie_word_embeddings
//
// Tied embeddings: a tied model has no lm_head parameter (logits use embed_tokens.weight), as
// save_pretrained writes tied checkpoints. load_state_dict accepts, and ignores, an
// lm_head.weight of the right shape for a tied model (some transformers versions list it).
//
// Modules call their children through mdist::nn::call and CausalLM's forward goes through
// mdist::nn::hooked, so fully_shard can wrap the root and each decoder layer.
//
// Numerics follow transformers: RMSNorm in fp32 then cast back before the weight multiply,
// rotate-half RoPE of every kind transformers has (mdist/hf/rotary.h), GQA by repeating k/v
// heads, causal scaled-dot-product attention with an optional padding mask and a sliding window
// on the layers whose type is sliding attention (LlamaConfig::window_of).
// Parameters are created in fp32 on the CPU; use ->to() for another dtype or device.
//
// Mixtures of experts route as transformers 5: router logits in the router's dtype (its input
// is cast to it, so a router kept in fp32 in a bf16 model routes in fp32), softmax in fp32,
// torch's topk (same tie-breaking), optional renormalisation, each chosen expert's output
// times its probability added up per token in expert order. transformers 5 holds the experts
// fused in memory (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]);
// mdist keeps one Linear per expert under the published checkpoints' names, and reads the
// fused layout too (hf::unfuse_experts).
//
// Built with device = kMeta, every parameter is a meta tensor (shape and dtype, no storage):
// each Linear, Embedding and RMSNorm gets its parameters on meta as it is built, so nothing of
// the model's size is ever allocated, and the module types stay the same (code that looks for
// every torch::nn::Linear still finds them). The rotary tables are real either way. Such a
// model cannot run; fsdp2_wrap it and load a checkpoint into it (hf::load_pretrained_fsdp2),
// or give it memory with mdist::nn::to_empty (mdist/nn/meta.h).
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mdist/hf/config.h"
#include "mdist/hf/kv_cache.h"
#include "mdist/hf/rotary.h"

namespace mdist::hf {

// HF's LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) in fp32, cast to x's dtype, times weight.
// weight_in_fp32 (OLMo 2's): times weight in fp32, then cast to x's dtype.
// unit_offset (Gemma's): times (1 + weight) in fp32, then cast; the weight starts at 0.
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps, c10::Device device = c10::kCPU, bool weight_in_fp32 = false,
              bool unit_offset = false);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
  bool weight_in_fp32 = false;
  bool unit_offset = false;
  // The mean of squares over the normalised features, from fp32 x (keepdim); empty: over x's
  // last dimension. hf::parallelize sets it for a norm over features split across ranks
  // (OLMo 2's q/k norms), whose mean needs the other ranks' squares.
  std::function<at::Tensor(const at::Tensor&)> mean_square;
};
TORCH_MODULE(RMSNorm);

struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const LlamaConfig& config, c10::Device device = c10::kCPU);
  // x [B, T, hidden]; cos, sin [B, T, head_dim]; mask: undefined (causal) or bool
  // [B, 1, T, K], true where a query may attend to a key. With a cache, this step's keys and
  // values are appended to it and the queries attend to all K = cached + T of them (without a
  // mask that is causal when the cache was empty, else all keys: DecoderModel leaves the mask
  // out after cached keys only for one query with no padding and no window).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& mask, LayerKvCache* cache = nullptr);
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  torch::nn::Linear qkv_proj{nullptr};       // Phi-3: instead of q/k/v_proj
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  // Qwen3 (per head), OLMo 2 (whole projection)
  bool qk_norm_full_width = false;           // LlamaConfig::qk_norm_full_width
  int64_t heads, kv_heads, head_dim;
  // Hook points (identities) for the keys and values [B, H_kv, T, D] as the attention reads
  // them: after RoPE and the k norm, before the grouped-query repeat and the KV cache, where
  // modelopt's k_bmm_quantizer / v_bmm_quantizer sit (mdist::quant's KV-cache quantizers hook
  // them). Not registered: they hold no state and stay out of named_modules().
  torch::nn::Identity k_bmm, v_bmm;
  std::optional<double> scale;    // of the scores: query_pre_attn_scalar ** -0.5 (Gemma);
                                  // none: 1 / sqrt(head_dim)
  std::optional<double> softcap;  // Gemma 2: tanh(scores / cap) * cap, before the mask
};
TORCH_MODULE(Attention);

struct MLPImpl : torch::nn::Module {  // SwiGLU
  explicit MLPImpl(const LlamaConfig& config, c10::Device device = c10::kCPU);
  // An MoE expert: intermediate size `intermediate`, no bias, Mixtral's names w1, w3, w2 for
  // gate_proj, up_proj, down_proj when `mixtral_names`.
  MLPImpl(int64_t hidden, int64_t intermediate, bool mixtral_names, c10::Device device);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  torch::nn::Linear gate_up_proj{nullptr};  // Phi-3: instead of gate_proj and up_proj
  bool gelu_tanh = false;                   // Gemma: GELU (tanh approximation) instead of SiLU
};
TORCH_MODULE(MLP);

// The routed experts' computation, torchtitan's GroupedExperts: rows [M, hidden] grouped by
// expert and counts [n] (int64: rows of each of the n experts it holds, in order) -> one output
// row per row, in the same order. `tokens` [M] (int64) names the token each row belongs to; the
// computation does not use it, but expert parallelism does (below). It holds no parameters of
// its own (the experts are registered in ExpertsImpl, under the checkpoints' names) and knows
// no group: expert parallelism (ep::ExpertParallel, installed by hf::parallelize_experts)
// hooks it, sending the rows to their experts' owners before it runs (each expert's rows in
// token order, as ep::dispatch_combine sends them: the order of the rows is the order in which
// an expert's weight gradient sums them) and the outputs back after.
struct GroupedExpertsImpl : torch::nn::Module {
  explicit GroupedExpertsImpl(std::vector<MLP> experts);
  at::Tensor forward(const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& tokens);
  std::vector<MLP> experts;  // ExpertsImpl's, shared
};
TORCH_MODULE(GroupedExperts);

// The routed experts of a sparse MoE block (transformers' MoeExperts), registered under their
// global indices ("experts.N.gate_proj.weight"): all of them, or with expert parallelism
// (hf::parallelize_experts) only the E / ep of this rank, the rest never held. The block calls
// it once per forward through mdist::nn::call, also when no token chose a local expert, so an
// FSDP unit around it (hf::shard_experts) gathers and reduces on every rank alike.
struct ExpertsImpl : torch::nn::Module {
  ExpertsImpl(const LlamaConfig& config, c10::Device device = c10::kCPU);
  // Experts [first, first + local.size()) of num_experts (hf::parallelize_experts).
  ExpertsImpl(std::vector<MLP> local, int64_t first, int64_t num_experts);
  // tokens [N, hidden], chosen and weights [N, top_k] -> [N, hidden]: the sum over the top-k
  // slots of weight x expert(token). As transformers: the (slot, token) pairs sorted by expert
  // (stably), the rows run through `grouped`, each expert's weighted outputs added to its
  // tokens one expert at a time in ascending order (index_add per expert: within one expert a
  // token appears once, so each token's sum is in expert order on any device, bf16 included).
  // The rows are sorted by expert and gathered once: a per-expert mask, nonzero and gather cost
  // more than the experts' matrix products on small batches.
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& chosen, const at::Tensor& weights);
  std::vector<MLP> local;  // local[i] is expert first + i
  int64_t first = 0;
  int64_t num_experts = 0;  // of the layer (the router's outputs)
  // Runs the experts on the sorted rows; not registered (it has no parameters), so the
  // module tree and its names stay the checkpoints'.
  GroupedExperts grouped{nullptr};
};
TORCH_MODULE(Experts);

// Qwen3-MoE's, Qwen2-MoE's and Mixtral's sparse MoE block: router `gate` and experts
// (MoeConfig). Expert parallelism: hf::parallelize_experts (mdist/hf/expert_parallel.h).
struct SparseMoeBlockImpl : torch::nn::Module {
  SparseMoeBlockImpl(const LlamaConfig& config, c10::Device device = c10::kCPU);
  // x [B, T, hidden] -> [B, T, hidden]; keeps this call's router logits in router_logits.
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear gate{nullptr};  // the router: hidden -> num_experts, no bias
  Experts experts{nullptr};
  // Qwen2-MoE: run on every token, added times sigmoid(shared_expert_gate(x)); else null.
  MLP shared_expert{nullptr};
  torch::nn::Linear shared_expert_gate{nullptr};
  int64_t top_k;
  bool norm_topk_prob;
  // Qwen3-MoE casts the top-k probabilities to the router logits' dtype; Mixtral keeps fp32.
  bool probabilities_to_logits_dtype;
  // The last forward's router logits [B * T, num_experts] (in the router's dtype, with their
  // autograd graph), for the load-balancing loss.
  at::Tensor router_logits;
};
TORCH_MODULE(SparseMoeBlock);

struct DecoderLayerImpl : torch::nn::Module {
  // `index`: the layer's number, which decides dense or sparse (LlamaConfig::sparse_layer).
  DecoderLayerImpl(const LlamaConfig& config, c10::Device device = c10::kCPU, int64_t index = 0);
  // Called by DecoderModel through mdist::nn::call, which runs this layer's hooks.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& mask, LayerKvCache* cache = nullptr);
  Attention self_attn{nullptr};
  MLP mlp{nullptr};             // a dense layer
  SparseMoeBlock moe{nullptr};  // a sparse layer (registered as "mlp" or "block_sparse_moe")
  // Pre-norm (the others): input_layernorm before attention, post_attention_layernorm
  // before the MLP. Post-norm (OLMo 2, LlamaConfig::post_norms): no input_layernorm;
  // post_attention_layernorm and post_feedforward_layernorm on the sub-layers' outputs.
  // Sandwich norms (Gemma, LlamaConfig::sandwich_norms): input_layernorm and
  // pre_feedforward_layernorm before the sub-layers, post_attention_layernorm and
  // post_feedforward_layernorm on their outputs before the residual adds.
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  RMSNorm pre_feedforward_layernorm{nullptr}, post_feedforward_layernorm{nullptr};
};
TORCH_MODULE(DecoderLayer);

// HF's LlamaModel (the checkpoint's "model."): embeddings, decoder layers, final norm.
struct DecoderModelImpl : torch::nn::Module {
  explicit DecoderModelImpl(const LlamaConfig& config, c10::Device device = c10::kCPU);
  // input_ids [B, T] (int64); attention_mask: undefined or [B, T] of 0/1 (1: a real token);
  // position_ids: undefined (0..T-1 for every row, as HF's forward) or [B, T] / [T].
  // Packed sequences as transformers trains them: position_ids restarting at 0 for each
  // document, no attention_mask and no cache; each token then attends only within its own
  // document (block-diagonal causal mask, sliding windows within the document).
  // Returns the final hidden states [B, T, hidden].
  // With a cache (mdist/hf/kv_cache.h) holding P positions: attention_mask is undefined or
  // [B, P + T], position_ids default to P..P+T-1, and the new keys and values are appended.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                     const at::Tensor& position_ids, KvCache* cache = nullptr);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  std::vector<DecoderLayer> decoder_layers;  // layers, typed
  RMSNorm norm{nullptr};
  // Not parameters or buffers, as HF's non-persistent inv_freq; holds the dynamic-RoPE state.
  RotaryEmbedding rotary;
  // Gemma 3: the sliding layers' own RoPE (LlamaConfig::sliding_rope_config); else none.
  std::optional<RotaryEmbedding> sliding_rotary;
  std::vector<bool> sliding_rope_layers;  // per layer: uses sliding_rotary
  bool rotary_in_fp32 = false;            // OLMo 2: cos and sin stay fp32 in a bf16 model
  // Gemma: the embeddings times sqrt(hidden_size) (in the embeddings' dtype); none: not scaled.
  std::optional<double> embed_scale;
  std::vector<std::optional<int64_t>> windows;  // each layer's attention window (none: full)
  // Per layer: run under activation checkpointing when training (empty: none). Set by
  // hf::apply_activation_checkpointing (mdist/hf/activation_checkpointing.h).
  std::vector<bool> checkpointed_layers;

 private:
  at::Tensor checkpointed_layer(std::size_t i, const at::Tensor& h, const at::Tensor& cos,
                                const at::Tensor& sin, const at::Tensor& mask);
};
TORCH_MODULE(DecoderModel);

struct CausalLMImpl : torch::nn::Module {
  // device: kCPU (parameters initialised as torch::nn's modules do) or kMeta (no storage);
  // anything else is an Error (build on the CPU, then ->to()).
  explicit CausalLMImpl(LlamaConfig config, c10::Device device = c10::kCPU);
  // Logits [B, T, vocab] (see DecoderModelImpl::forward for the arguments, the cache's
  // included: a KvCache of config.num_hidden_layers layers, owned by the caller).
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask = {},
                     const at::Tensor& position_ids = {}, KvCache* cache = nullptr);
  at::Tensor body(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                  const at::Tensor& position_ids, KvCache* cache);
  // The output projection's weight: lm_head.weight, or embed_tokens.weight when tied.
  at::Tensor output_weight() const;
  // causal_lm_loss(logits, labels): HF's shifted cross entropy.
  static at::Tensor loss(const at::Tensor& logits, const at::Tensor& labels);
  // Of a mixture of experts: the router logits of the last forward, one [B * T, num_experts]
  // per sparse layer in layer order (transformers' output_router_logits); empty for a dense
  // model. Valid until the next forward.
  std::vector<at::Tensor> router_logits() const;
  // The load-balancing loss of the last forward (load_balancing_loss of router_logits() with
  // that forward's attention_mask, as transformers' MoE CausalLMs compute aux_loss), not yet
  // times router_aux_loss_coef. Throws Error for a dense model.
  at::Tensor aux_loss(const at::Tensor& attention_mask = {}) const;

  LlamaConfig config;
  DecoderModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};  // null when tie_word_embeddings
  // The model knows nothing of its parallelization: hf::apply_parallelism
  // (mdist/hf/parallelize.h) splits its modules in place and returns the plans (hf::Parallelism)
  // that the loss, the full logits, saving and loading of a split model take.
};
TORCH_MODULE(CausalLM);

// HF's causal-LM loss: cross entropy of logits [B, T, V] at t against labels [B, T] at t + 1,
// in fp32, ignoring labels of -100, mean over the tokens not ignored.
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels);
// transformers' load_balancing_loss_func (Switch Transformer eq. 4-6) over every layer's
// router logits [N, E]: num_experts * sum_e f_e * P_e, f_e the share of top-k choices that
// went to expert e, P_e the mean softmax probability of e, both over all layers' tokens;
// with an attention_mask [B, T] (N = B * T), padding tokens count in neither. The softmax runs
// in the logits' dtype, as transformers'; the result is fp32. Gradients flow through P only.
at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, int64_t num_experts,
                               int64_t top_k, const at::Tensor& attention_mask = {});

inline at::Tensor CausalLMImpl::loss(const at::Tensor& logits, const at::Tensor& labels) {
  return causal_lm_loss(logits, labels);
}

// Copies `tensors` into `model`'s parameters by name (dtype converted, shapes must match).
// Throws mdist::Error naming the missing, unexpected and mis-shaped keys. An lm_head.weight
// for a tied model (no lm_head parameter) of embed_tokens' shape is ignored.
void load_state_dict(torch::nn::Module& model, const std::map<std::string, at::Tensor>& tensors);
// A mixture of experts also takes transformers 5's fused expert layout (unfuse_experts).
void load_state_dict(CausalLM& model, const std::map<std::string, at::Tensor>& tensors);

// transformers 5's in-memory layout of a mixture of experts -> the published checkpoints' keys
// (CausalLM's names): P.experts.gate_up_proj [E, 2I, H] becomes P.experts.N.gate_proj.weight
// (rows [0, I)) and up_proj (rows [I, 2I)), P.experts.down_proj [E, H, I] P.experts.N.down_proj;
// for Mixtral, whose P is "...mlp" there, also P.gate.weight, and the names become
// "...block_sparse_moe" with w1 / w3 / w2. Other keys pass through; a dense config returns the
// map as is. Throws Error naming a fused tensor whose shape does not fit the config.
std::map<std::string, at::Tensor> unfuse_experts(const LlamaConfig& config,
                                                 std::map<std::string, at::Tensor> tensors);

// One of CausalLM's per-expert parameters inside a fused tensor of transformers 5's layout:
// rows [first_row, first_row + rows) of fused[expert], or (expert = -1: Mixtral's renamed
// router) the whole tensor.
struct ExpertSlice {
  std::string name;  // the parameter's name
  int64_t expert;
  int64_t first_row;
  int64_t rows;
};
// The parameters a fused checkpoint key of `shape` holds (unfuse_experts' mapping); empty for
// any other key or a dense config. Throws Error naming a fused key whose shape does not fit.
std::vector<ExpertSlice> expert_slices(const LlamaConfig& config, const std::string& key,
                                       c10::IntArrayRef shape);

}  // namespace mdist::hf
