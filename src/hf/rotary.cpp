// mdist::hf rotary embeddings: every RoPE kind of transformers 5.24's modeling_rope_utils.
//
// Exactness: Python evaluates `scalar / tensor` as tensor.reciprocal() * scalar (two
// roundings), not as one division, and `scalar ** tensor` as pow(Scalar, Tensor); the scalar
// arithmetic (correction ranges, attention factors) runs in double. The code below does the
// same operations in the same order, so that its tables are bit-equal to transformers'.
#include "mdist/hf/rotary.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "mdist/error.h"

namespace mdist::hf {
namespace {

// Python's `a / t` for a scalar a and a tensor t.
at::Tensor rdiv(double a, const at::Tensor& t) { return t.reciprocal() * a; }

// arange(0, dim, 2) as int64, then fp32, / dim: the exponents of theta.
at::Tensor exponents(int64_t dim) {
  return torch::arange(0, dim, 2, torch::kInt64).to(at::kFloat) / dim;
}

// 1 / theta ** exponents: the plain RoPE frequencies.
at::Tensor plain(double theta, int64_t dim) { return rdiv(1.0, at::pow(theta, exponents(dim))); }

const RopeScaling& scaling_of(const LlamaConfig& c) { return *c.rope_scaling; }

at::Tensor linear(const LlamaConfig& c, int64_t dim) {
  at::Tensor inv_freq = plain(c.rope_theta, dim);
  return inv_freq.div_(*scaling_of(c).factor);
}

// NTK-aware scaling: theta grows with the sequence beyond max_position_embeddings. At
// construction (no seq_len) the arithmetic is Python's, in double (and leaves theta as it is);
// in a forward it is on 0-dim tensors, fp32 (the sequence length is a tensor there).
at::Tensor dynamic(const LlamaConfig& c, int64_t dim, std::optional<int64_t> seq_len) {
  if (dim <= 2) throw Error("mdist::hf: dynamic RoPE needs a rotary dimension above 2");
  const double factor = *scaling_of(c).factor;
  const int64_t context = c.max_position_embeddings;
  const double exponent = static_cast<double>(dim) / static_cast<double>(dim - 2);
  if (!seq_len) {
    const double ratio = factor * static_cast<double>(context) / static_cast<double>(context);
    return plain(c.rope_theta * std::pow(ratio - (factor - 1), exponent), dim);
  }
  const at::Tensor length =
      at::maximum(at::scalar_tensor(*seq_len, at::kLong), at::scalar_tensor(context, at::kLong));
  const at::Tensor base =
      at::pow(length * factor / context - (factor - 1), exponent) * c.rope_theta;
  return rdiv(1.0, at::pow(base, exponents(dim)));
}

double yarn_mscale(double scale, double mscale) {
  if (scale <= 1) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

// The dimension whose wavelength makes `rotations` turns over `context` positions.
double correction_dim(double rotations, int64_t dim, double theta, int64_t context) {
  return (static_cast<double>(dim) *
          std::log(static_cast<double>(context) / (rotations * 2 * std::numbers::pi))) /
         (2 * std::log(theta));
}

RopeFrequencies yarn(const LlamaConfig& c, int64_t dim) {
  const RopeScaling& s = scaling_of(c);
  const double factor = *s.factor;
  double attention = 0;
  if (s.attention_factor) {
    attention = *s.attention_factor;
  } else if (s.mscale.value_or(0) != 0 && s.mscale_all_dim.value_or(0) != 0) {
    attention = yarn_mscale(factor, *s.mscale) / yarn_mscale(factor, *s.mscale_all_dim);
  } else {
    attention = yarn_mscale(factor, 1);
  }
  // 0 or absent: the paper's 32 and 1.
  const double beta_fast = s.beta_fast.value_or(0) != 0 ? *s.beta_fast : 32;
  const double beta_slow = s.beta_slow.value_or(0) != 0 ? *s.beta_slow : 1;
  const at::Tensor pos_freqs = at::pow(c.rope_theta, exponents(dim));
  const at::Tensor extrapolation = rdiv(1.0, pos_freqs);
  const at::Tensor interpolation = rdiv(1.0, pos_freqs * factor);

  const int64_t context = s.original_max_position_embeddings;
  double low = correction_dim(beta_fast, dim, c.rope_theta, context);
  double high = correction_dim(beta_slow, dim, c.rope_theta, context);
  if (s.truncate.value_or(true)) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // no division by zero in the ramp
  const at::Tensor ramp =
      ((torch::arange(dim / 2, torch::kFloat) - low) / (high - low)).clamp(0, 1);
  const at::Tensor extrapolation_factor = 1 - ramp;
  return {interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor,
          attention};
}

RopeFrequencies longrope(const LlamaConfig& c, int64_t dim, std::optional<int64_t> seq_len) {
  const RopeScaling& s = scaling_of(c);
  const int64_t original = s.original_max_position_embeddings;
  // No factor: the ratio of the context lengths (Phi-3 configs).
  const double factor =
      s.factor ? *s.factor
               : static_cast<double>(c.max_position_embeddings) / static_cast<double>(original);
  double attention = 1.0;
  if (s.attention_factor) {
    attention = *s.attention_factor;
  } else if (factor > 1.0) {
    attention = std::sqrt(1 + std::log(factor) / std::log(static_cast<double>(original)));
  }
  const bool long_context = seq_len && *seq_len > original;
  const auto& factors = long_context ? s.long_factor : s.short_factor;
  const at::Tensor ext = torch::tensor(factors, torch::kDouble).to(at::kFloat);
  return {rdiv(1.0, ext * at::pow(c.rope_theta, exponents(dim))), attention};
}

// Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between.
at::Tensor llama3(const LlamaConfig& c, int64_t dim) {
  const RopeScaling& s = scaling_of(c);
  const at::Tensor inv_freq = plain(c.rope_theta, dim);
  const double factor = *s.factor;
  const int64_t old_context = s.original_max_position_embeddings;
  const double low_freq_wavelen = static_cast<double>(old_context) / s.low_freq_factor;
  const double high_freq_wavelen = static_cast<double>(old_context) / s.high_freq_factor;
  const at::Tensor wavelen = rdiv(2 * std::numbers::pi, inv_freq);
  const at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq);
  const at::Tensor smooth = (wavelen.reciprocal() * old_context - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
  const at::Tensor smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
  const at::Tensor medium = (wavelen < high_freq_wavelen)
                                .logical_not()
                                .logical_and((wavelen > low_freq_wavelen).logical_not());
  return at::where(medium, smoothed, scaled);
}

}  // namespace

int64_t rotary_dim(const LlamaConfig& config) {
  return static_cast<int64_t>(static_cast<double>(config.head_dim) * config.partial_rotary_factor);
}

RopeFrequencies rope_frequencies(const LlamaConfig& config, std::optional<int64_t> seq_len) {
  const int64_t dim = rotary_dim(config);
  if (!config.rope_scaling) return {plain(config.rope_theta, dim), 1.0};
  const std::string& type = config.rope_scaling->rope_type;
  if (type == "linear") return {linear(config, dim), 1.0};
  if (type == "dynamic") return {dynamic(config, dim, seq_len), 1.0};
  if (type == "yarn") return yarn(config, dim);
  if (type == "longrope") return longrope(config, dim, seq_len);
  if (type == "llama3") return {llama3(config, dim), 1.0};
  throw Error("mdist::hf: unsupported rope_type '" + type + "'");
}

at::Tensor rope_inv_freq(const LlamaConfig& config) { return rope_frequencies(config).inv_freq; }

RotaryEmbedding::RotaryEmbedding(const LlamaConfig& config)
    : config_(config), max_seq_len_cached_(config.max_position_embeddings) {
  RopeFrequencies f = rope_frequencies(config_);
  inv_freq_ = f.inv_freq;
  original_inv_freq_ = f.inv_freq;
  attention_scaling_ = f.attention_scaling;
}

// transformers' dynamic_rope_update, run before each forward's tables.
void RotaryEmbedding::update(int64_t seq_len) {
  if (!config_.rope_scaling) return;
  const std::string& type = config_.rope_scaling->rope_type;
  const int64_t original_max = config_.max_position_embeddings;
  if (type == "dynamic") {
    if (seq_len > max_seq_len_cached_) {  // growth
      RopeFrequencies f = rope_frequencies(config_, seq_len);
      inv_freq_ = f.inv_freq;
      attention_scaling_ = f.attention_scaling;
      max_seq_len_cached_ = seq_len;
    } else if (seq_len < original_max && max_seq_len_cached_ > original_max) {  // reset
      inv_freq_ = original_inv_freq_;
      max_seq_len_cached_ = original_max;
    }
  } else if (type == "longrope") {
    const int64_t original = config_.rope_scaling->original_max_position_embeddings;
    if (!long_inv_freq_.defined())
      long_inv_freq_ = rope_frequencies(config_, original + 1).inv_freq;
    inv_freq_ = seq_len > original ? long_inv_freq_ : original_inv_freq_;
  }
}

std::pair<at::Tensor, at::Tensor> RotaryEmbedding::cos_sin(const at::Tensor& positions,
                                                           at::ScalarType dtype) {
  if (positions.numel() > 0) update(positions.max().item<int64_t>() + 1);
  const at::Tensor freqs =
      positions.unsqueeze(-1).to(at::kFloat) * inv_freq_.to(positions.device(), at::kFloat);
  const at::Tensor angles = at::cat({freqs, freqs}, -1);
  return {(angles.cos() * attention_scaling_).to(dtype),
          (angles.sin() * attention_scaling_).to(dtype)};
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto rotate_half = [](const at::Tensor& t) {
    const int64_t half = t.size(-1) / 2;
    return at::cat({-t.slice(-1, half), t.slice(-1, 0, half)}, -1);
  };
  const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  const int64_t rotated = cos.size(-1);
  if (rotated == x.size(-1)) return x * c + rotate_half(x) * s;
  const at::Tensor part = x.slice(-1, 0, rotated);
  return at::cat({part * c + rotate_half(part) * s, x.slice(-1, rotated)}, -1);
}

}  // namespace mdist::hf
