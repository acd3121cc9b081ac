#pragma once
// The configuration of a Hugging Face Llama-family causal LM (config.json), for
// mdist::hf::CausalLM. Supported architectures: LlamaForCausalLM, MistralForCausalLM,
// Qwen2ForCausalLM, Qwen3ForCausalLM and the mixtures of experts Qwen3MoeForCausalLM,
// Qwen2MoeForCausalLM and MixtralForCausalLM, whose decoders differ only in what this struct
// holds.
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

// Llama 3's frequency-dependent RoPE scaling ("rope_type": "llama3"), the only one supported.
struct RopeScaling {
  std::string rope_type = "llama3";
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

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
  std::optional<RopeScaling> rope_scaling;  // none: plain RoPE
  std::optional<int64_t> sliding_window;    // Mistral (Qwen2/3 only with use_sliding_window)
  std::optional<int64_t> pad_token_id;      // embed_tokens' padding_idx (no gradient)
  std::string hidden_act = "silu";          // the only one supported
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // bias on q/k/v_proj (Llama attention_bias; always for Qwen2)
  bool o_bias = false;    // bias on o_proj (Llama attention_bias; never for Qwen2)
  bool mlp_bias = false;  // Llama mlp_bias
  bool qk_norm = false;   // Qwen3: RMSNorm over head_dim of q and k (q_norm, k_norm)
  std::string torch_dtype = "float32";  // "torch_dtype" (transformers 4) or "dtype" (5)
  std::optional<MoeConfig> moe;         // none: a dense model

  // Whether decoder layer `layer` has the sparse MoE block (else a dense MLP).
  bool sparse_layer(int64_t layer) const;

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
