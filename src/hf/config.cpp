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
    "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM";

bool supported(const std::string& architecture) {
  for (const char* name :
       {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
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
  if (model_type == "qwen3_moe") return "Qwen3MoeForCausalLM";
  if (model_type == "qwen2_moe") return "Qwen2MoeForCausalLM";
  if (model_type == "mixtral") return "MixtralForCausalLM";
  fail("unsupported model_type '" + model_type + "' (supported architectures: " + kSupported + ")");
}

// A rope_scaling (transformers 4) or rope_parameters (5) object; null or "default": none.
std::optional<RopeScaling> parse_rope(const Json& rope, const char* key) {
  if (rope.is_null()) return std::nullopt;
  if (!rope.is_object()) fail(std::string("key '") + key + "' is not an object");
  std::string type = optional_as<std::string>(rope, "rope_type", "");
  if (type.empty()) type = optional_as<std::string>(rope, "type", "default");
  if (type == "default") return std::nullopt;
  if (type != "llama3") {
    fail(std::string("unsupported ") + key + " type '" + type + "' (supported: llama3)");
  }
  RopeScaling s;
  s.rope_type = type;
  s.factor = required_as<double>(rope, "factor");
  s.low_freq_factor = required_as<double>(rope, "low_freq_factor");
  s.high_freq_factor = required_as<double>(rope, "high_freq_factor");
  s.original_max_position_embeddings =
      required_as<int64_t>(rope, "original_max_position_embeddings");
  if (!(s.high_freq_factor > s.low_freq_factor)) {
    fail("rope scaling needs high_freq_factor > low_freq_factor");
  }
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
};

Family family_of(const std::string& architecture) {
  Family f;
  f.qwen3 = architecture == "Qwen3ForCausalLM" || architecture == "Qwen3MoeForCausalLM";
  f.qwen2_moe = architecture == "Qwen2MoeForCausalLM";
  f.qwen = f.qwen3 || f.qwen2_moe || architecture == "Qwen2ForCausalLM";
  f.mixtral = architecture == "MixtralForCausalLM";
  f.mistral = f.mixtral || architecture == "MistralForCausalLM";
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
  // an explicit head_dim; Qwen2, Qwen3 and Mistral accept it (head_dim = hidden // heads).
  if (c.architecture == "LlamaForCausalLM" && c.hidden_size % c.num_attention_heads != 0) {
    fail("the hidden size (" + std::to_string(c.hidden_size) +
         ") is not a multiple of the number of attention heads (" +
         std::to_string(c.num_attention_heads) + ")");
  }
  const int64_t default_head_dim =
      c.architecture == "Qwen3ForCausalLM" ? 128 : c.hidden_size / c.num_attention_heads;
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
                                                                    : 2048);
  if (c.max_position_embeddings <= 0) fail("max_position_embeddings must be positive");
  c.rms_norm_eps = optional_as<double>(j, "rms_norm_eps", 1e-6);
  c.tie_word_embeddings = optional_as<bool>(j, "tie_word_embeddings", false);
  if (const auto it = j.find("pad_token_id"); it != j.end() && !it->is_null()) {
    c.pad_token_id = get_as<int64_t>(*it, "pad_token_id");
    if (*c.pad_token_id < 0 || *c.pad_token_id >= c.vocab_size) {
      fail("pad_token_id " + std::to_string(*c.pad_token_id) + " is outside the vocabulary");
    }
  }
  c.hidden_act = optional_as<std::string>(j, "hidden_act", "silu");
  if (c.hidden_act != "silu")
    fail("unsupported hidden_act '" + c.hidden_act + "' (supported: silu)");
  c.torch_dtype = optional_as<std::string>(j, "torch_dtype", "");
  if (c.torch_dtype.empty()) c.torch_dtype = optional_as<std::string>(j, "dtype", "float32");
}

// RoPE: transformers 5 nests everything in rope_parameters; 4 has rope_theta + rope_scaling.
void read_rope(const Json& j, LlamaConfig& c) {
  if (const auto it = j.find("rope_parameters"); it != j.end() && !it->is_null()) {
    c.rope_theta =
        optional_as<double>(*it, "rope_theta", optional_as<double>(j, "rope_theta", 10000.0));
    c.rope_scaling = parse_rope(*it, "rope_parameters");
  } else {
    c.rope_theta = optional_as<double>(j, "rope_theta", 10000.0);
    if (const auto s = j.find("rope_scaling"); s != j.end())
      c.rope_scaling = parse_rope(*s, "rope_scaling");
  }
  if (!(c.rope_theta > 0)) fail("rope_theta must be positive");
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
  }
}

// Mistral's and Mixtral's attention window; the other architectures have none.
void read_sliding_window(const Json& j, LlamaConfig& c) {
  if (c.architecture == "MixtralForCausalLM") {
    // MixtralConfig: no window unless one is given.
    if (const auto it = j.find("sliding_window"); it != j.end() && !it->is_null()) {
      c.sliding_window = get_as<int64_t>(*it, "sliding_window");
      if (*c.sliding_window <= 0) fail("sliding_window must be positive");
    }
  } else if (c.architecture == "MistralForCausalLM") {
    // Absent: MistralConfig's default window of 4096; null: no window.
    if (const auto it = j.find("sliding_window"); it == j.end()) {
      c.sliding_window = 4096;
    } else if (!it->is_null()) {
      c.sliding_window = get_as<int64_t>(*it, "sliding_window");
      if (*c.sliding_window <= 0) fail("sliding_window must be positive");
    }
  } else if (optional_as<bool>(j, "use_sliding_window", false)) {
    fail("use_sliding_window=true is not supported for " + c.architecture);
  }
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
  read_rope(j, c);
  read_biases(j, family, c);
  read_sliding_window(j, c);
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
  const bool v5_rope = j.contains("rope_parameters");
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
  j["hidden_act"] = hidden_act;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j[v5_dtype ? "dtype" : "torch_dtype"] = torch_dtype;
  if (architecture == "LlamaForCausalLM" || architecture == "Qwen3ForCausalLM" ||
      architecture == "Qwen3MoeForCausalLM") {
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
  if (architecture == "MistralForCausalLM" || architecture == "MixtralForCausalLM") {
    j["sliding_window"] = sliding_window ? Json(*sliding_window) : Json(nullptr);
  }

  Json scaling = nullptr;
  if (rope_scaling) {
    scaling = {
        {"rope_type", rope_scaling->rope_type},
        {"factor", rope_scaling->factor},
        {"low_freq_factor", rope_scaling->low_freq_factor},
        {"high_freq_factor", rope_scaling->high_freq_factor},
        {"original_max_position_embeddings", rope_scaling->original_max_position_embeddings}};
  }
  j.erase("rope_scaling");
  j.erase("rope_parameters");
  j.erase("rope_theta");
  if (v5_rope) {
    Json params = scaling.is_null() ? Json{{"rope_type", "default"}} : scaling;
    params["rope_theta"] = rope_theta;
    j["rope_parameters"] = params;
  } else {
    j["rope_theta"] = rope_theta;
    j["rope_scaling"] = scaling;
  }
  return j.dump(2) + "\n";
}

}  // namespace mdist::hf
