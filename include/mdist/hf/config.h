#pragma once
// The configuration of a Hugging Face Llama-family causal LM (config.json), for
// mdist::hf::CausalLM. Supported architectures: LlamaForCausalLM, MistralForCausalLM,
// Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4),
// Olmo2ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM (Gemma 3 text) and the mixtures of
// experts Qwen3MoeForCausalLM, Qwen2MoeForCausalLM and
// MixtralForCausalLM, whose decoders differ only in what this struct holds.
//
// Both config.json styles are read: transformers 4 (top-level "rope_theta" and
// "rope_scaling") and transformers 5 ("rope_parameters" holding rope_theta and rope_type).
// Keys not listed here (bos_token_id, use_cache, ...) are kept and written back by to_json().
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mdist/error.h"

namespace mdist::hf {

// config.json is malformed, lacks a required key or asks for something unsupported.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A RoPE scaling of transformers' ROPE_INIT_FUNCTIONS (config.json "rope_scaling" in
// transformers 4, "rope_parameters" in 5): "linear", "dynamic", "yarn", "longrope" or "llama3".
// The math is in mdist/hf/rotary.h. Optional keys that were absent stay unset, so that to_json
// writes back what was read.
struct RopeScaling {
  std::string rope_type = "llama3";
  // Every kind but longrope requires it; longrope's default is
  // max_position_embeddings / original_max_position_embeddings. yarn: null means that ratio too.
  std::optional<double> factor = 8.0;
  // llama3, yarn, longrope; absent: max_position_embeddings (as transformers standardises it).
  int64_t original_max_position_embeddings = 8192;
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
  // yarn and longrope: the factor cos and sin are multiplied by; absent: derived from factor
  // (yarn: also from mscale / mscale_all_dim).
  std::optional<double> attention_factor;
  std::optional<double> beta_fast, beta_slow;     // yarn; absent (or 0): 32 and 1
  std::optional<double> mscale, mscale_all_dim;   // yarn
  std::optional<bool> truncate;                   // yarn; absent: true
  std::vector<double> short_factor, long_factor;  // longrope: one per rotary frequency
};

// Which attention a decoder layer runs (config.json "layer_types").
enum class LayerType { kFullAttention, kSlidingAttention };

// The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral: a router (a bias-free Linear
// hidden -> num_experts, softmax in fp32, top num_experts_per_tok) and num_experts SwiGLU
// experts of moe_intermediate_size, their outputs summed with the top-k probabilities.
struct MoeConfig {
  int64_t num_experts = 0;  // Qwen3 "num_experts", Mixtral "num_local_experts"
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;  // Mixtral: intermediate_size
  bool norm_topk_prob = false;        // top-k probabilities renormalised to sum 1 (Mixtral: always)
  // Qwen3-MoE: layer i is sparse unless i is in mlp_only_layers or (i + 1) % step != 0; the
  // others get a dense MLP of intermediate_size. Mixtral: every layer is sparse.
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  double router_aux_loss_coef = 0.001;  // weight of the load-balancing loss in training
  bool output_router_logits = false;    // transformers adds the aux loss to its loss only then
  // Qwen2-MoE: a shared expert of this intermediate size, run on every token and added times
  // sigmoid(shared_expert_gate(x)); 0: none.
  int64_t shared_expert_intermediate_size = 0;
  // Parameter names: Mixtral's "block_sparse_moe" with experts w1 (gate), w3 (up), w2 (down);
  // Qwen3-MoE's "mlp" with gate_proj, up_proj, down_proj.
  bool mixtral_names = false;
};

struct LlamaConfig {
  std::string architecture;                // e.g. "LlamaForCausalLM" (architectures[0])
  std::vector<std::string> architectures;  // as in config.json
  std::string model_type;                  // "llama", "mistral", "qwen2", "qwen3"
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // default: num_attention_heads (fewer: GQA)
  int64_t head_dim = 0;             // default: hidden_size / num_attention_heads
  int64_t max_position_embeddings = 2048;
  int64_t vocab_size = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<RopeScaling> rope_scaling;  // none: plain RoPE ("default")
  // The fraction of head_dim that RoPE rotates (the first channels); the rest pass through.
  // Read for every family, but only 1 is accepted by the current ones (see config.cpp).
  double partial_rotary_factor = 1.0;
  // The attention window of the layers layer_types marks sliding (Mistral, Mixtral and
  // Qwen3-MoE: every layer; Qwen2/Qwen3/Qwen2-MoE only with use_sliding_window).
  std::optional<int64_t> sliding_window;
  // One per decoder layer: read from "layer_types" or derived as the architecture's config
  // class derives it (Qwen2/Qwen3: use_sliding_window and max_window_layers). Empty when the
  // architecture has no per-layer types (Llama: all full; Mistral, Mixtral, Qwen3-MoE: all
  // sliding when sliding_window is set).
  std::vector<LayerType> layer_types;
  std::optional<int64_t> pad_token_id;  // embed_tokens' padding_idx (no gradient)
  // "silu" (SwiGLU), or Gemma's "gelu_pytorch_tanh" (GeGLU with tanh-approximated GELU; read
  // from "hidden_activation").
  std::string hidden_act = "silu";
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // bias on q/k/v_proj (Llama attention_bias; always for Qwen2)
  bool o_bias = false;    // bias on o_proj (Llama attention_bias; never for Qwen2)
  bool mlp_bias = false;  // Llama mlp_bias
  bool qk_norm = false;   // Qwen3, OLMo 2: RMSNorm of q and k (q_norm, k_norm)
  // OLMo 2: q_norm and k_norm span the whole projection (heads * head_dim) and run before the
  // split into heads; Qwen3's span one head.
  bool qk_norm_full_width = false;
  // Phi-3: q/k/v as one qkv_proj (rows q, then k, then v) and gate/up as one gate_up_proj
  // (rows gate, then up), as the checkpoints store them; kept fused so the names stay theirs.
  bool fused_projections = false;
  // OLMo 2: no input_layernorm; post_attention_layernorm and post_feedforward_layernorm
  // normalise each sub-layer's output before it is added to the residual.
  bool post_norms = false;
  // OLMo 2's numerics: RMSNorm multiplies by its weight in fp32 before the cast back, and the
  // rotary tables stay fp32 (q and k are rotated in fp32, then cast back).
  bool fp32_norm_weight_and_rotary = false;
  // Gemma 2 / Gemma 3: four norms per layer ("sandwich"): input_layernorm before attention,
  // post_attention_layernorm on the attention output before the residual add, and
  // pre_feedforward_layernorm / post_feedforward_layernorm around the MLP likewise.
  bool sandwich_norms = false;
  // Gemma: RMSNorm multiplies by (1 + weight) in fp32, then casts (the weights start at 0).
  bool norm_unit_offset = false;
  // Gemma: the embeddings are multiplied by sqrt(hidden_size), that factor rounded to the
  // model's dtype first.
  bool scale_embeddings = false;
  // Gemma: attention scores scaled by query_pre_attn_scalar ** -0.5 (none: head_dim ** -0.5).
  std::optional<int64_t> query_pre_attn_scalar;  // an int in transformers' config classes
  // Gemma 2: tanh(x / cap) * cap on the attention scores (before the mask) and on the logits.
  std::optional<double> attn_logit_softcapping;
  std::optional<double> final_logit_softcapping;
  // Gemma 3: the sliding layers' own RoPE (rope_parameters["sliding_attention"], transformers
  // 4's rope_local_base_freq); rope_theta / rope_scaling are then the full-attention layers'.
  // None: every layer shares one RoPE.
  std::optional<double> sliding_rope_theta;
  std::optional<RopeScaling> sliding_rope_scaling;
  std::string torch_dtype = "float32";  // "torch_dtype" (transformers 4) or "dtype" (5)
  std::optional<MoeConfig> moe;         // none: a dense model

  // Whether decoder layer `layer` has the sparse MoE block (else a dense MLP).
  bool sparse_layer(int64_t layer) const;
  // The attention window of decoder layer `layer`; none: full causal attention.
  std::optional<int64_t> window_of(int64_t layer) const;
  // The config whose rope_theta / rope_scaling are the sliding layers' RoPE (Gemma 3); this
  // config when they share one.
  LlamaConfig sliding_rope_config() const;

  // Throws ConfigError naming the architecture, the missing key or the unsupported value.
  static LlamaConfig from_json(const std::string& text);
  static LlamaConfig from_file(const std::string& path);

  // config.json text: the keys read from the source (if any) with this struct's values.
  std::string to_json() const;

  // The config.json this was read from, for keys this struct does not model; empty if built
  // in code.
  std::string source_json;
};

}  // namespace mdist::hf
