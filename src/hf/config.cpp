// mdist::hf::LlamaConfig: config.json in both transformers 4 and 5 styles.
#include "mdist/hf/config.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>
#include <string_view>

namespace mdist::hf {
namespace {

using Json = nlohmann::json;

[[noreturn]] void fail(const std::string& what) {
  throw ConfigError("mdist::hf::LlamaConfig: " + what);
}

const Json& required(const Json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) fail(std::string("missing required key '") + key + "'");
  return *it;
}

template <class T>
T get_as(const Json& value, std::string_view key) {
  try {
    return value.get<T>();
  } catch (const Json::exception&) {
    fail("key '" + std::string(key) + "' has the wrong type: " + value.dump());
  }
}

template <class T>
T required_as(const Json& j, const char* key) {
  return get_as<T>(required(j, key), key);
}

template <class T>
T optional_as(const Json& j, const char* key, T fallback) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  return get_as<T>(*it, key);
}

constexpr const char* kSupported =
    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
    "Phi3ForCausalLM, Olmo2ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, "
    "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM";

bool supported(const std::string& architecture) {
  for (const char* name :
       {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
        "Phi3ForCausalLM", "Olmo2ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
        "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"}) {
    if (architecture == name) return true;
  }
  return false;
}

std::string architecture_of(const Json& j, std::vector<std::string>& architectures) {
  if (const auto it = j.find("architectures"); it != j.end() && !it->is_null()) {
    architectures = get_as<std::vector<std::string>>(*it, "architectures");
    if (!architectures.empty()) return architectures.front();
  }
  // No architectures: infer from model_type, as transformers' AutoModelForCausalLM does.
  const auto it = j.find("model_type");
  if (it == j.end() || it->is_null()) fail("missing required key 'architectures'");
  const auto model_type = get_as<std::string>(*it, "model_type");
  if (model_type == "llama") return "LlamaForCausalLM";
  if (model_type == "mistral") return "MistralForCausalLM";
  if (model_type == "qwen2") return "Qwen2ForCausalLM";
  if (model_type == "qwen3") return "Qwen3ForCausalLM";
  if (model_type == "phi3") return "Phi3ForCausalLM";
  if (model_type == "olmo2") return "Olmo2ForCausalLM";
  if (model_type == "gemma2") return "Gemma2ForCausalLM";
  if (model_type == "gemma3_text") return "Gemma3ForCausalLM";
  if (model_type == "qwen3_moe") return "Qwen3MoeForCausalLM";
  if (model_type == "qwen2_moe") return "Qwen2MoeForCausalLM";
  if (model_type == "mixtral") return "MixtralForCausalLM";
  fail("unsupported model_type '" + model_type + "' (supported architectures: " + kSupported + ")");
}

// A number or a list of numbers of a rope object, with the key named when it is not one.
std::vector<double> required_factors(const Json& rope, const char* key) {
  const Json& value = required(rope, key);
  if (!value.is_array()) fail("rope key '" + std::string(key) + "' is not a list of numbers");
  return get_as<std::vector<double>>(value, key);
}

template <class T>
std::optional<T> maybe(const Json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  return get_as<T>(*it, key);
}

// A rope_scaling (transformers 4) or rope_parameters (5) object; null, empty or "default":
// none. The required keys are those of transformers' _validate_<kind>_rope_parameters (a missing
// one is its KeyError); values the math cannot use (a non-positive factor) are refused too,
// where transformers only warns and then fails or computes nonsense.
std::optional<RopeScaling> parse_rope(const Json& rope, const char* key,
                                      int64_t max_position_embeddings) {
  if (rope.is_null() || (rope.is_object() && rope.empty())) return std::nullopt;
  if (!rope.is_object()) fail(std::string("key '") + key + "' is not an object");
  for (const char* type : {"full_attention", "sliding_attention"}) {
    if (rope.contains(type)) {
      fail(std::string(key) + " per layer type ('" + type +
           "') is not supported for this architecture");
    }
  }
  std::string type = optional_as<std::string>(rope, "rope_type", "");
  if (type.empty()) type = optional_as<std::string>(rope, "type", "default");
  if (type == "default") return std::nullopt;
  if (type != "linear" && type != "dynamic" && type != "yarn" && type != "longrope" &&
      type != "llama3") {
    fail(std::string("unsupported ") + key + " type '" + type +
         "' (supported: default, linear, dynamic, yarn, longrope, llama3)");
  }
  RopeScaling s;
  s.rope_type = type;
  const auto where = [&](const char* name) {
    return std::string(key) + " '" + name + "' (rope_type " + type + ")";
  };
  const auto need = [&](const char* name) {
    if (!rope.contains(name)) fail("missing required key " + where(name));
  };
  if (type != "longrope") need("factor");
  // null: yarn derives it (below); the others need a number.
  s.factor = type == "yarn" || type == "longrope"
                 ? maybe<double>(rope, "factor")
                 : std::optional(required_as<double>(rope, "factor"));
  // transformers' standardize_rope_params: absent, it is max_position_embeddings.
  s.original_max_position_embeddings =
      optional_as<int64_t>(rope, "original_max_position_embeddings", max_position_embeddings);
  if (s.original_max_position_embeddings <= 0) {
    fail(where("original_max_position_embeddings") + " must be positive");
  }
  if (type == "llama3") {
    need("low_freq_factor");
    need("high_freq_factor");
    s.low_freq_factor = required_as<double>(rope, "low_freq_factor");
    s.high_freq_factor = required_as<double>(rope, "high_freq_factor");
    if (!(s.high_freq_factor > s.low_freq_factor)) {
      fail("rope scaling needs high_freq_factor > low_freq_factor");
    }
  }
  if (type == "yarn" || type == "longrope")
    s.attention_factor = maybe<double>(rope, "attention_factor");
  if (type == "yarn") {
    s.beta_fast = maybe<double>(rope, "beta_fast");
    s.beta_slow = maybe<double>(rope, "beta_slow");
    s.mscale = maybe<double>(rope, "mscale");
    s.mscale_all_dim = maybe<double>(rope, "mscale_all_dim");
    s.truncate = maybe<bool>(rope, "truncate");
    if (!s.factor) {
      s.factor = static_cast<double>(max_position_embeddings) /
                 static_cast<double>(s.original_max_position_embeddings);
    }
  }
  if (type == "longrope") {
    need("short_factor");
    need("long_factor");
    s.short_factor = required_factors(rope, "short_factor");
    s.long_factor = required_factors(rope, "long_factor");
  }
  if (s.factor && !(*s.factor > 0)) fail(where("factor") + " must be positive");
  return s;
}

// The MoE keys of Qwen3MoeConfig / MixtralConfig (their defaults when absent), checked as
// transformers' configs and modules would fail on them.
MoeConfig parse_moe(const Json& j, const LlamaConfig& c) {
  MoeConfig m;
  const bool mixtral = c.architecture == "MixtralForCausalLM";
  m.mixtral_names = mixtral;
  // transformers maps either key to the same attribute (attribute_map): published Qwen3-MoE
  // configs say num_experts, transformers 5 writes num_local_experts for both.
  const int64_t local_experts = optional_as<int64_t>(j, "num_local_experts", mixtral ? 8 : 128);
  if (mixtral) {
    m.num_experts = optional_as<int64_t>(j, "num_experts", local_experts);
    m.num_experts_per_tok = optional_as<int64_t>(j, "num_experts_per_tok", 2);
    m.moe_intermediate_size = c.intermediate_size;
    m.norm_topk_prob = true;
    if (optional_as<double>(j, "router_jitter_noise", 0.0) != 0.0) {
      fail("router_jitter_noise other than 0 is not supported");
    }
  } else if (c.architecture == "Qwen2MoeForCausalLM") {  // Qwen2MoeConfig's defaults
    m.num_experts = optional_as<int64_t>(j, "num_experts", 60);
    m.num_experts_per_tok = optional_as<int64_t>(j, "num_experts_per_tok", 4);
    m.moe_intermediate_size = optional_as<int64_t>(j, "moe_intermediate_size", 1408);
    m.shared_expert_intermediate_size =
        optional_as<int64_t>(j, "shared_expert_intermediate_size", 5632);
    if (m.shared_expert_intermediate_size <= 0) {
      fail("shared_expert_intermediate_size must be positive");
    }
  } else {
    m.num_experts = optional_as<int64_t>(j, "num_experts", local_experts);
    m.num_experts_per_tok = optional_as<int64_t>(j, "num_experts_per_tok", 8);
    m.moe_intermediate_size = optional_as<int64_t>(j, "moe_intermediate_size", 768);
  }
  if (!mixtral) {
    m.norm_topk_prob = optional_as<bool>(j, "norm_topk_prob", false);
    m.decoder_sparse_step = optional_as<int64_t>(j, "decoder_sparse_step", 1);
    m.mlp_only_layers = optional_as<std::vector<int64_t>>(j, "mlp_only_layers", {});
  }
  m.router_aux_loss_coef = optional_as<double>(j, "router_aux_loss_coef", 0.001);
  m.output_router_logits = optional_as<bool>(j, "output_router_logits", false);
  if (m.num_experts <= 0) {
    fail(std::string(mixtral ? "num_local_experts" : "num_experts") + " " +
         std::to_string(m.num_experts) + " must be positive");
  }
  if (m.num_experts_per_tok <= 0 || m.num_experts_per_tok > m.num_experts) {
    fail("num_experts_per_tok " + std::to_string(m.num_experts_per_tok) +
         " must be between 1 and the number of experts (" + std::to_string(m.num_experts) + ")");
  }
  if (m.moe_intermediate_size <= 0) fail("moe_intermediate_size must be positive");
  if (m.decoder_sparse_step <= 0) fail("decoder_sparse_step must be positive");
  for (const int64_t layer : m.mlp_only_layers) {
    if (layer < 0 || layer >= c.num_hidden_layers) {
      fail("mlp_only_layers names layer " + std::to_string(layer) + " of " +
           std::to_string(c.num_hidden_layers));
    }
  }
  if (!(m.router_aux_loss_coef >= 0)) fail("router_aux_loss_coef must not be negative");
  return m;
}

// Which transformers config class an architecture's defaults come from.
struct Family {
  bool qwen3 = false;      // Qwen3, Qwen3-MoE
  bool qwen2_moe = false;  // Qwen2-MoE
  bool qwen = false;       // any Qwen
  bool mixtral = false;
  bool mistral = false;  // Mistral, Mixtral
  bool phi3 = false;     // Phi-3, Phi-3.5, Phi-4
  bool olmo2 = false;
  bool gemma2 = false;
  bool gemma3 = false;  // Gemma 3 text
  bool gemma = false;   // either
};

Family family_of(const std::string& architecture) {
  Family f;
  f.qwen3 = architecture == "Qwen3ForCausalLM" || architecture == "Qwen3MoeForCausalLM";
  f.qwen2_moe = architecture == "Qwen2MoeForCausalLM";
  f.qwen = f.qwen3 || f.qwen2_moe || architecture == "Qwen2ForCausalLM";
  f.mixtral = architecture == "MixtralForCausalLM";
  f.mistral = f.mixtral || architecture == "MistralForCausalLM";
  f.phi3 = architecture == "Phi3ForCausalLM";
  f.olmo2 = architecture == "Olmo2ForCausalLM";
  f.gemma2 = architecture == "Gemma2ForCausalLM";
  f.gemma3 = architecture == "Gemma3ForCausalLM";
  f.gemma = f.gemma2 || f.gemma3;
  return f;
}

Json parse_config_object(const std::string& text) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    fail(std::string("config.json is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) fail("config.json is not a JSON object");
  return j;
}

// The layer sizes, head counts and head_dim, checked against each other.
void read_sizes(const Json& j, const Family& family, LlamaConfig& c) {
  c.hidden_size = required_as<int64_t>(j, "hidden_size");
  c.intermediate_size = required_as<int64_t>(j, "intermediate_size");
  c.num_hidden_layers = required_as<int64_t>(j, "num_hidden_layers");
  c.num_attention_heads = required_as<int64_t>(j, "num_attention_heads");
  c.vocab_size = required_as<int64_t>(j, "vocab_size");
  const int64_t default_kv_heads = c.architecture == "Qwen3MoeForCausalLM" ? 4
                                   : family.qwen2_moe                      ? 16
                                   : family.qwen                           ? 32
                                   : family.mistral                        ? 8
                                   : family.gemma                          ? 4
                                                                           : c.num_attention_heads;
  c.num_key_value_heads =
      j.contains("num_key_value_heads")
          ? optional_as<int64_t>(j, "num_key_value_heads", c.num_attention_heads)
          : default_kv_heads;
  if (c.hidden_size <= 0 || c.intermediate_size <= 0 || c.num_hidden_layers <= 0 ||
      c.num_attention_heads <= 0 || c.num_key_value_heads <= 0 || c.vocab_size <= 0) {
    fail(
        "sizes must be positive (hidden_size, intermediate_size, num_hidden_layers, "
        "num_attention_heads, num_key_value_heads, vocab_size)");
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    fail("num_attention_heads " + std::to_string(c.num_attention_heads) +
         " is not a multiple of num_key_value_heads " + std::to_string(c.num_key_value_heads));
  }
  // LlamaConfig.validate_architecture refuses a hidden size the heads do not divide, even with
  // an explicit head_dim (so do Gemma2Config and Gemma3TextConfig); Qwen2, Qwen3 and Mistral
  // accept it (head_dim = hidden // heads).
  if ((c.architecture == "LlamaForCausalLM" || family.gemma) &&
      c.hidden_size % c.num_attention_heads != 0) {
    fail("the hidden size (" + std::to_string(c.hidden_size) +
         ") is not a multiple of the number of attention heads (" +
         std::to_string(c.num_attention_heads) + ")");
  }
  const int64_t default_head_dim = c.architecture == "Qwen3ForCausalLM" ? 128
                                   : family.gemma                       ? 256
                                                  : c.hidden_size / c.num_attention_heads;
  c.head_dim = optional_as<int64_t>(j, "head_dim", default_head_dim);
  if (c.head_dim <= 0) fail("head_dim " + std::to_string(c.head_dim) + " must be positive");
  if (c.head_dim % 2 != 0) {
    fail("RoPE requires an even rotary dimension, but head_dim is " + std::to_string(c.head_dim));
  }
}

// Context length, norm epsilon, tying, padding, activation and dtype.
void read_model_settings(const Json& j, const Family& family, LlamaConfig& c) {
  c.max_position_embeddings = optional_as<int64_t>(j, "max_position_embeddings",
                                                   family.qwen      ? 32768
                                                   : family.mistral ? 131072
                                                   : family.phi3    ? 4096
                                                   : family.gemma2  ? 8192
                                                   : family.gemma3  ? 131072
                                                                    : 2048);
  if (c.max_position_embeddings <= 0) fail("max_position_embeddings must be positive");
  c.rms_norm_eps =
      optional_as<double>(j, "rms_norm_eps", family.phi3 || family.olmo2 ? 1e-5 : 1e-6);
  c.tie_word_embeddings = optional_as<bool>(j, "tie_word_embeddings", family.gemma);
  // Phi3Config, Olmo2Config and the Gemma configs default pad_token_id to 32000, 1 and 0 (the
  // others to none); a null in config.json is none for every family.
  const auto pad = j.find("pad_token_id");
  if (pad == j.end() && (family.phi3 || family.olmo2 || family.gemma)) {
    c.pad_token_id = family.phi3 ? 32000 : family.olmo2 ? 1 : 0;
    if (*c.pad_token_id >= c.vocab_size) {
      fail("pad_token_id defaults to " + std::to_string(*c.pad_token_id) + " for " +
           c.architecture + ", outside the vocabulary of " + std::to_string(c.vocab_size) +
           " (set pad_token_id in config.json)");
    }
  } else if (pad != j.end() && !pad->is_null()) {
    c.pad_token_id = get_as<int64_t>(*pad, "pad_token_id");
    if (*c.pad_token_id < 0 || *c.pad_token_id >= c.vocab_size) {
      fail("pad_token_id " + std::to_string(*c.pad_token_id) + " is outside the vocabulary");
    }
  }
  if (family.gemma) {
    // Gemma's MLP reads hidden_activation (a hidden_act beside it, as in Gemma 2's published
    // configs, is not used).
    c.hidden_act = optional_as<std::string>(j, "hidden_activation", "gelu_pytorch_tanh");
    if (c.hidden_act != "gelu_pytorch_tanh") {
      fail("unsupported hidden_activation '" + c.hidden_act + "' for " + c.architecture +
           " (supported: gelu_pytorch_tanh)");
    }
  } else {
    c.hidden_act = optional_as<std::string>(j, "hidden_act", "silu");
    if (c.hidden_act != "silu")
      fail("unsupported hidden_act '" + c.hidden_act + "' (supported: silu)");
  }
  c.torch_dtype = optional_as<std::string>(j, "torch_dtype", "");
  if (c.torch_dtype.empty()) c.torch_dtype = optional_as<std::string>(j, "dtype", "float32");
}

// Where the RoPE settings are: transformers 5's "rope_parameters" or transformers 4's
// "rope_scaling" (which transformers prefers when both are set and not empty).
const char* rope_key(const Json& j) {
  const auto set = [&](const char* key) {
    const auto it = j.find(key);
    return it != j.end() && !it->is_null() && !(it->is_object() && it->empty());
  };
  if (set("rope_scaling")) return "rope_scaling";
  if (set("rope_parameters")) return "rope_parameters";
  return j.contains("rope_parameters") ? "rope_parameters" : "rope_scaling";
}

// Phi3Config's spellings: its older checkpoints' "su" and "yarn" are longrope (transformers
// renames them as it reads the config).
void phi3_rope(Json& rope) {
  for (const char* name : {"rope_type", "type"}) {
    const auto it = rope.find(name);
    if (it != rope.end() && it->is_string() && (*it == "su" || *it == "yarn")) *it = "longrope";
  }
}

// RoPE: theta and partial_rotary_factor from the rope object, else from the top level (as
// transformers' convert_rope_params_to_dict moves them in), else the config class's default.
// Gemma3TextConfig.convert_rope_params_to_dict: one rope object per layer type
// ("rope_parameters": {"full_attention": {...}, "sliding_attention": {...}}, a null or absent
// one meaning plain RoPE), transformers 4's "rope_scaling" merged over the full-attention one,
// theta from the object, else "rope_theta" (full; default 1e6) or "rope_local_base_freq"
// (sliding; default 1e4).
void read_gemma3_rope(const Json& j, LlamaConfig& c) {
  Json full = Json::object(), sliding = Json::object();
  if (const auto it = j.find("rope_parameters"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) fail("key 'rope_parameters' is not an object");
    for (const auto& [type, value] : it->items()) {
      if (type != "full_attention" && type != "sliding_attention") {
        fail("rope_parameters of " + c.architecture +
             " must be one object per layer type (full_attention, sliding_attention), not '" +
             type + "'");
      }
      if (!value.is_null() && !value.is_object()) {
        fail("rope_parameters '" + type + "' is not an object");
      }
      if (value.is_object()) (type == "full_attention" ? full : sliding) = value;
    }
  }
  if (const auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) fail("key 'rope_scaling' is not an object");
    for (const auto& [key, value] : it->items()) full[key] = value;
  }
  const double top_partial = optional_as<double>(j, "partial_rotary_factor", 1.0);
  c.partial_rotary_factor = optional_as<double>(full, "partial_rotary_factor", top_partial);
  if (optional_as<double>(sliding, "partial_rotary_factor", top_partial) != 1.0) {
    c.partial_rotary_factor = optional_as<double>(sliding, "partial_rotary_factor", top_partial);
  }
  c.rope_theta =
      optional_as<double>(full, "rope_theta", optional_as<double>(j, "rope_theta", 1000000.0));
  c.sliding_rope_theta = optional_as<double>(
      sliding, "rope_theta", optional_as<double>(j, "rope_local_base_freq", 10000.0));
  if (!(*c.sliding_rope_theta > 0)) fail("the sliding layers' rope_theta must be positive");
  full.erase("rope_theta");
  sliding.erase("rope_theta");
  c.rope_scaling = parse_rope(full, "rope_parameters['full_attention']", c.max_position_embeddings);
  c.sliding_rope_scaling =
      parse_rope(sliding, "rope_parameters['sliding_attention']", c.max_position_embeddings);
}

void read_rope(const Json& j, const Family& family, LlamaConfig& c) {
  const char* key = rope_key(j);
  if (family.gemma3) {
    read_gemma3_rope(j, c);
  } else {
    const auto it = j.find(key);
    Json rope = it == j.end() ? Json() : *it;
    if (family.phi3 && rope.is_object()) phi3_rope(rope);
    const double default_theta = family.mixtral ? 1000000.0 : 10000.0;  // MixtralConfig's
    const double top_theta = optional_as<double>(j, "rope_theta", default_theta);
    const double top_partial = optional_as<double>(j, "partial_rotary_factor", 1.0);
    c.rope_theta =
        rope.is_object() ? optional_as<double>(rope, "rope_theta", top_theta) : top_theta;
    c.partial_rotary_factor = rope.is_object()
                                  ? optional_as<double>(rope, "partial_rotary_factor", top_partial)
                                  : top_partial;
    c.rope_scaling = parse_rope(rope, key, c.max_position_embeddings);
  }
  if (!(c.rope_theta > 0)) fail("rope_theta must be positive");
  if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1)) {
    fail("partial_rotary_factor must be in (0, 1]");
  }
  // The attention of the other architectures in transformers 5.24 rotates the whole head: it
  // ignores the factor with the default RoPE and fails on shapes with the others. Phi-3's
  // rotates the first int(head_dim * factor) channels (mdist/hf/rotary.h).
  if (c.partial_rotary_factor != 1.0 && !family.phi3) {
    fail("partial_rotary_factor " + std::to_string(c.partial_rotary_factor) +
         " is not supported for " + c.architecture + " (its attention rotates the whole head)");
  }
  const int64_t rotary =
      static_cast<int64_t>(static_cast<double>(c.head_dim) * c.partial_rotary_factor);
  if (rotary % 2 != 0 || rotary == 0) {
    fail("RoPE requires an even rotary dimension, but head_dim " + std::to_string(c.head_dim) +
         " times partial_rotary_factor is " + std::to_string(rotary));
  }
  if (family.phi3 && c.rope_scaling && c.rope_scaling->rope_type != "longrope") {
    fail(std::string(key) + " type '" + c.rope_scaling->rope_type +
         "' is not supported for Phi3ForCausalLM (supported: default, longrope)");
  }
  if (family.phi3 && c.rope_scaling) {
    // Phi3Config keeps the pretraining length at the top level (default 4096), and
    // transformers gives it priority over the rope object's.
    c.rope_scaling->original_max_position_embeddings =
        optional_as<int64_t>(j, "original_max_position_embeddings", 4096);
    if (c.rope_scaling->original_max_position_embeddings <= 0) {
      fail("original_max_position_embeddings must be positive");
    }
  }
  // Gemma 3's sliding layers have their own rope object.
  const std::string sliding_key = "rope_parameters['sliding_attention']";
  for (const auto& [scaling, name] :
       {std::pair{&c.rope_scaling, family.gemma3 ? "rope_parameters['full_attention']" : key},
        std::pair{&c.sliding_rope_scaling, sliding_key.c_str()}}) {
    if (!*scaling || (*scaling)->rope_type != "longrope") continue;
    const std::size_t frequencies = static_cast<std::size_t>(rotary / 2);
    for (const auto* factors : {&(*scaling)->short_factor, &(*scaling)->long_factor}) {
      if (factors->size() != frequencies) {
        fail(std::string(name) + " '" +
             (factors == &(*scaling)->short_factor ? "short_factor" : "long_factor") + "' has " +
             std::to_string(factors->size()) + " entries, but the rotary dimension " +
             std::to_string(rotary) + " needs " + std::to_string(frequencies));
      }
    }
  }
}

// Which projections carry a bias, and Qwen3's q/k norms.
void read_biases(const Json& j, const Family& family, LlamaConfig& c) {
  const bool attention_bias = optional_as<bool>(j, "attention_bias", false);
  if (c.architecture == "LlamaForCausalLM") {
    c.qkv_bias = c.o_bias = attention_bias;
    c.mlp_bias = optional_as<bool>(j, "mlp_bias", false);
  } else if (c.architecture == "Qwen2ForCausalLM") {
    c.qkv_bias = true;  // Qwen2 configs carry no attention_bias: q/k/v always have one
  } else if (family.qwen2_moe) {
    c.qkv_bias = optional_as<bool>(j, "qkv_bias", true);  // o_proj never has one
  } else if (family.qwen3) {
    c.qkv_bias = c.o_bias = attention_bias;
    c.qk_norm = true;
  } else if (family.phi3) {
    c.fused_projections = true;  // no bias anywhere
  } else if (family.olmo2) {
    c.qkv_bias = c.o_bias = attention_bias;
    c.qk_norm = c.qk_norm_full_width = true;
    c.post_norms = true;
    c.fp32_norm_weight_and_rotary = true;
  } else if (family.gemma) {
    c.qkv_bias = c.o_bias = attention_bias;
    c.qk_norm = family.gemma3;  // per head
    c.sandwich_norms = c.norm_unit_offset = c.scale_embeddings = true;
  }
}

// A soft-capping value: null is none, a number must be positive.
std::optional<double> softcap(const Json& j, const char* key, std::optional<double> fallback) {
  const auto it = j.find(key);
  if (it == j.end()) return fallback;
  if (it->is_null()) return std::nullopt;
  const auto cap = get_as<double>(*it, key);
  if (!(cap > 0)) fail(std::string(key) + " must be positive (or null)");
  return cap;
}

// Gemma's attention scale and soft-capping (Gemma 2 caps by default, Gemma 3 does not).
void read_gemma_attention(const Json& j, const Family& family, LlamaConfig& c) {
  if (!family.gemma) return;
  if (const auto it = j.find("query_pre_attn_scalar");
      it != j.end() && !it->is_null() && !it->is_number_integer()) {
    fail("query_pre_attn_scalar must be an integer, got " + it->dump());
  }
  c.query_pre_attn_scalar = optional_as<int64_t>(j, "query_pre_attn_scalar", 256);
  if (!(*c.query_pre_attn_scalar > 0)) fail("query_pre_attn_scalar must be positive");
  c.attn_logit_softcapping =
      softcap(j, "attn_logit_softcapping", family.gemma2 ? std::optional(50.0) : std::nullopt);
  c.final_logit_softcapping =
      softcap(j, "final_logit_softcapping", family.gemma2 ? std::optional(30.0) : std::nullopt);
  if (optional_as<bool>(j, "use_bidirectional_attention", false)) {
    fail("use_bidirectional_attention=true is not supported for " + c.architecture +
         " (mdist's attention is causal)");
  }
}

// "layer_types" as transformers validates it (PreTrainedConfig.validate_layer_type: one per
// layer; "attention" is its legacy name of full_attention); types other than full and sliding
// attention are refused as unsupported.
std::vector<LayerType> parse_layer_types(const Json& j, const LlamaConfig& c) {
  const auto it = j.find("layer_types");
  if (it == j.end() || it->is_null()) return {};
  if (!it->is_array()) fail("key 'layer_types' is not a list of strings");
  const auto names = get_as<std::vector<std::string>>(*it, "layer_types");
  if (static_cast<int64_t>(names.size()) != c.num_hidden_layers) {
    fail("layer_types has " + std::to_string(names.size()) + " entries for " +
         std::to_string(c.num_hidden_layers) + " layers (num_hidden_layers)");
  }
  std::vector<LayerType> types;
  for (const auto& name : names) {
    if (name == "full_attention" || name == "attention") {
      types.push_back(LayerType::kFullAttention);
    } else if (name == "sliding_attention") {
      types.push_back(LayerType::kSlidingAttention);
    } else {
      fail("unsupported layer type '" + name +
           "' in layer_types (supported: full_attention, sliding_attention)");
    }
  }
  return types;
}

std::optional<int64_t> positive_window(const Json& value) {
  if (value.is_null()) return std::nullopt;
  const auto window = get_as<int64_t>(value, "sliding_window");
  if (window <= 0) fail("sliding_window must be positive");
  return window;
}

// The attention window and which layers it applies to, as each architecture's config class
// and attention module decide them.
void read_attention_layers(const Json& j, const Family& family, LlamaConfig& c) {
  // Validated for every architecture, as transformers does; only Qwen2, Qwen3 and Qwen2-MoE
  // read them (the others' attention ignores layer_types).
  const std::vector<LayerType> given = parse_layer_types(j, c);
  if (c.architecture == "MixtralForCausalLM") {
    // MixtralConfig: no window unless one is given; then every layer is windowed.
    if (const auto it = j.find("sliding_window"); it != j.end())
      c.sliding_window = positive_window(*it);
    return;
  }
  if (c.architecture == "MistralForCausalLM") {
    // Absent: MistralConfig's default window of 4096 (every layer); null: no window.
    const auto it = j.find("sliding_window");
    c.sliding_window = it == j.end() ? std::optional<int64_t>(4096) : positive_window(*it);
    return;
  }
  if (family.phi3) {
    // Phi3Config: no window unless one is given; then every layer is windowed.
    if (const auto it = j.find("sliding_window"); it != j.end())
      c.sliding_window = positive_window(*it);
    return;
  }
  if (family.gemma) {
    // Gemma2Config / Gemma3TextConfig: a window of 4096 unless given (null: none); without
    // layer_types every second layer (Gemma 2: 0, 2, ...) or all but every
    // sliding_window_pattern-th (Gemma 3, default 6: 5 sliding, then 1 full) slides.
    const auto it = j.find("sliding_window");
    c.sliding_window = it == j.end() ? std::optional<int64_t>(4096) : positive_window(*it);
    c.layer_types = given;
    if (c.layer_types.empty()) {
      const int64_t pattern =
          family.gemma2 ? 2 : optional_as<int64_t>(j, "sliding_window_pattern", 6);
      if (pattern <= 0) fail("sliding_window_pattern must be positive");
      for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
        c.layer_types.push_back((i + 1) % pattern != 0 ? LayerType::kSlidingAttention
                                                       : LayerType::kFullAttention);
      }
    }
    for (std::size_t i = 0; i < c.layer_types.size(); ++i) {
      if (c.layer_types[i] == LayerType::kSlidingAttention && !c.sliding_window) {
        fail("layer_types makes layer " + std::to_string(i) +
             " sliding_attention, but sliding_window is null");
      }
    }
    return;
  }
  if (!family.qwen) {  // Llama, OLMo 2: no window
    if (optional_as<bool>(j, "use_sliding_window", false)) {
      fail("use_sliding_window=true is not supported for " + c.architecture);
    }
    return;
  }
  // Qwen: the window exists only with use_sliding_window (default 4096).
  const bool use_window = optional_as<bool>(j, "use_sliding_window", false);
  if (use_window) {
    const auto it = j.find("sliding_window");
    c.sliding_window = it == j.end() ? std::optional<int64_t>(4096) : positive_window(*it);
  }
  // Qwen3-MoE's attention has no layer types: its window applies to every layer.
  if (c.architecture == "Qwen3MoeForCausalLM") return;
  const int64_t max_window_layers = optional_as<int64_t>(j, "max_window_layers", 28);
  c.layer_types = given;
  if (c.layer_types.empty()) {
    // Qwen2Config / Qwen3Config: the layers from max_window_layers on slide. Qwen2MoeConfig:
    // the even-numbered layers (0, 2, ...) below max_window_layers.
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const bool sliding = family.qwen2_moe
                               ? use_window && (i + 1) % 2 != 0 && i < max_window_layers
                               : c.sliding_window.has_value() && i >= max_window_layers;
      c.layer_types.push_back(sliding ? LayerType::kSlidingAttention : LayerType::kFullAttention);
    }
  }
  for (std::size_t i = 0; i < c.layer_types.size(); ++i) {
    if (c.layer_types[i] == LayerType::kSlidingAttention && !c.sliding_window) {
      fail("layer_types makes layer " + std::to_string(i) +
           " sliding_attention, but there is no sliding_window (use_sliding_window is false or "
           "sliding_window null)");
    }
  }
}

// A rope object: `rope`'s keys that RopeScaling does not model, with `scaling`'s (none: no
// scaling keys). Theta and the partial factor are the caller's.
Json rope_json(Json rope, const std::optional<RopeScaling>& scaling) {
  for (const char* known :
       {"type", "rope_type", "factor", "low_freq_factor", "high_freq_factor", "attention_factor",
        "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "short_factor",
        "long_factor", "rope_theta", "partial_rotary_factor"}) {
    rope.erase(known);
  }
  if (scaling) {
    const RopeScaling& r = *scaling;
    rope["rope_type"] = r.rope_type;
    if (r.factor) rope["factor"] = *r.factor;
    // linear and dynamic do not use it: a source's value stays as it was.
    if (r.rope_type == "llama3" || r.rope_type == "yarn" || r.rope_type == "longrope") {
      rope["original_max_position_embeddings"] = r.original_max_position_embeddings;
    }
    if (r.rope_type == "llama3") {
      rope["low_freq_factor"] = r.low_freq_factor;
      rope["high_freq_factor"] = r.high_freq_factor;
    }
    const auto put = [&](const char* name, const auto& value) {
      if (value) rope[name] = *value;
    };
    put("attention_factor", r.attention_factor);
    put("beta_fast", r.beta_fast);
    put("beta_slow", r.beta_slow);
    put("mscale", r.mscale);
    put("mscale_all_dim", r.mscale_all_dim);
    put("truncate", r.truncate);
    if (r.rope_type == "longrope") {
      rope["short_factor"] = r.short_factor;
      rope["long_factor"] = r.long_factor;
    }
  }
  return rope;
}

}  // namespace

// The steps run in a fixed order, so that a config with several problems always reports the
// same one first.
LlamaConfig LlamaConfig::from_json(const std::string& text) {
  const Json j = parse_config_object(text);
  LlamaConfig c;
  c.source_json = text;
  c.architecture = architecture_of(j, c.architectures);
  if (!supported(c.architecture)) {
    fail("unsupported architecture '" + c.architecture + "' (supported: " + kSupported + ")");
  }
  if (c.architectures.empty()) c.architectures = {c.architecture};
  c.model_type = optional_as<std::string>(j, "model_type", "");
  // The defaults of transformers' config class of each architecture (a key left out of
  // config.json means that class's default, not one shared value).
  const Family family = family_of(c.architecture);
  read_sizes(j, family, c);
  read_model_settings(j, family, c);
  read_rope(j, family, c);
  read_biases(j, family, c);
  read_attention_layers(j, family, c);
  read_gemma_attention(j, family, c);
  if (c.architecture == "Qwen3MoeForCausalLM" || family.qwen2_moe || family.mixtral) {
    c.moe = parse_moe(j, c);
  }
  return c;
}

bool LlamaConfig::sparse_layer(int64_t layer) const {
  if (!moe) return false;
  for (const int64_t dense : moe->mlp_only_layers) {
    if (dense == layer) return false;
  }
  return (layer + 1) % moe->decoder_sparse_step == 0;
}

std::optional<int64_t> LlamaConfig::window_of(int64_t layer) const {
  if (layer_types.empty()) return sliding_window;
  const bool sliding =
      layer_types.at(static_cast<std::size_t>(layer)) == LayerType::kSlidingAttention;
  return sliding ? sliding_window : std::nullopt;
}

LlamaConfig LlamaConfig::sliding_rope_config() const {
  LlamaConfig sliding = *this;
  if (sliding_rope_theta) {
    sliding.rope_theta = *sliding_rope_theta;
    sliding.rope_scaling = sliding_rope_scaling;
  }
  return sliding;
}

LlamaConfig LlamaConfig::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  try {
    return from_json(text.str());
  } catch (const ConfigError& e) {
    throw ConfigError(std::string(e.what()) + " (in '" + path + "')");
  }
}

std::string LlamaConfig::to_json() const {
  Json j = Json::object();
  if (!source_json.empty()) j = Json::parse(source_json);
  const bool v5_dtype = j.contains("dtype") && !j.contains("torch_dtype");

  j["architectures"] =
      architectures.empty() ? std::vector<std::string>{architecture} : architectures;
  if (!model_type.empty()) j["model_type"] = model_type;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["max_position_embeddings"] = max_position_embeddings;
  j["vocab_size"] = vocab_size;
  j["rms_norm_eps"] = rms_norm_eps;
  j["pad_token_id"] = pad_token_id ? Json(*pad_token_id) : Json(nullptr);
  // Gemma's MLP reads hidden_activation.
  j[family_of(architecture).gemma ? "hidden_activation" : "hidden_act"] = hidden_act;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j[v5_dtype ? "dtype" : "torch_dtype"] = torch_dtype;
  if (architecture == "LlamaForCausalLM" || architecture == "Qwen3ForCausalLM" ||
      architecture == "Qwen3MoeForCausalLM" || architecture == "Olmo2ForCausalLM" ||
      family_of(architecture).gemma) {
    j["attention_bias"] = qkv_bias;
  }
  if (architecture == "LlamaForCausalLM") j["mlp_bias"] = mlp_bias;
  if (moe) {
    j[moe->mixtral_names ? "num_local_experts" : "num_experts"] = moe->num_experts;
    j["num_experts_per_tok"] = moe->num_experts_per_tok;
    if (!moe->mixtral_names) {
      j["moe_intermediate_size"] = moe->moe_intermediate_size;
      j["norm_topk_prob"] = moe->norm_topk_prob;
      j["decoder_sparse_step"] = moe->decoder_sparse_step;
      j["mlp_only_layers"] = moe->mlp_only_layers;
    }
    if (moe->shared_expert_intermediate_size > 0) {
      j["shared_expert_intermediate_size"] = moe->shared_expert_intermediate_size;
    }
    j["router_aux_loss_coef"] = moe->router_aux_loss_coef;
    j["output_router_logits"] = moe->output_router_logits;
  }
  if (architecture == "Phi3ForCausalLM" && rope_scaling) {
    j["original_max_position_embeddings"] = rope_scaling->original_max_position_embeddings;
  }
  if (architecture == "MistralForCausalLM" || architecture == "MixtralForCausalLM" ||
      architecture == "Phi3ForCausalLM") {
    j["sliding_window"] = sliding_window ? Json(*sliding_window) : Json(nullptr);
  } else if (family_of(architecture).gemma) {
    j["sliding_window"] = sliding_window ? Json(*sliding_window) : Json(nullptr);
    std::vector<std::string> names;
    for (const LayerType type : layer_types) {
      names.push_back(type == LayerType::kSlidingAttention ? "sliding_attention"
                                                           : "full_attention");
    }
    j["layer_types"] = names;
    j["query_pre_attn_scalar"] = query_pre_attn_scalar ? Json(*query_pre_attn_scalar) : Json(256);
    j["attn_logit_softcapping"] =
        attn_logit_softcapping ? Json(*attn_logit_softcapping) : Json(nullptr);
    j["final_logit_softcapping"] =
        final_logit_softcapping ? Json(*final_logit_softcapping) : Json(nullptr);
  } else if (family_of(architecture).qwen) {
    j["use_sliding_window"] = sliding_window.has_value();
    // Without a window the value is unused: keep the source's (Qwen2-MoE saves 0).
    if (sliding_window) {
      j["sliding_window"] = *sliding_window;
    } else if (!j.contains("sliding_window")) {
      j["sliding_window"] = nullptr;
    }
    if (!layer_types.empty()) {
      std::vector<std::string> names;
      for (const LayerType type : layer_types) {
        names.push_back(type == LayerType::kSlidingAttention ? "sliding_attention"
                                                             : "full_attention");
      }
      j["layer_types"] = names;
    }
  }

  // The rope object in the spelling it was read in (transformers 4's for a config built in
  // code), keeping the keys this struct does not model.
  const std::string key = rope_key(j);
  Json rope = rope_json(j.contains(key) && j.at(key).is_object() ? j.at(key) : Json::object(),
                        rope_scaling);
  if (sliding_rope_theta) {
    // Gemma 3: one object per layer type, transformers 5's spelling whatever was read.
    const Json source = j.contains("rope_parameters") && j.at("rope_parameters").is_object()
                            ? j.at("rope_parameters")
                            : Json::object();
    const auto of = [&](const char* type, const std::optional<RopeScaling>& scaling, double theta) {
      Json base =
          source.contains(type) && source.at(type).is_object() ? source.at(type) : Json::object();
      Json object = rope_json(std::move(base), scaling);
      if (!scaling) object["rope_type"] = "default";
      object["rope_theta"] = theta;
      return object;
    };
    j.erase("rope_scaling");
    j.erase("rope_theta");
    j.erase("rope_local_base_freq");
    j["rope_parameters"] = {
        {"full_attention", of("full_attention", rope_scaling, rope_theta)},
        {"sliding_attention", of("sliding_attention", sliding_rope_scaling, *sliding_rope_theta)}};
    return j.dump(2) + "\n";
  }
  j.erase("rope_scaling");
  j.erase("rope_parameters");
  j.erase("rope_theta");
  j.erase("partial_rotary_factor");
  if (key == std::string("rope_parameters")) {
    if (!rope_scaling) rope["rope_type"] = "default";
    rope["rope_theta"] = rope_theta;
    if (partial_rotary_factor != 1.0) rope["partial_rotary_factor"] = partial_rotary_factor;
    j["rope_parameters"] = rope;
  } else {
    j["rope_theta"] = rope_theta;
    if (partial_rotary_factor != 1.0) j["partial_rotary_factor"] = partial_rotary_factor;
    j["rope_scaling"] = rope_scaling ? rope : Json(nullptr);
  }
  return j.dump(2) + "\n";
}

}  // namespace mdist::hf
