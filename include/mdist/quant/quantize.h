#pragma once
// Post-training quantization of an hf::CausalLM as modelopt 0.47's
// `mtq.quantize(model, config, forward_loop)` with max calibration: an input and a weight
// TensorQuantizer on every torch::nn::Linear, configured by the QuantConfig's rules,
// calibrated on the forward loop, synced across ranks, then fake-quantizing in every forward.
//
//   auto quantized = mdist::quant::quantize(model, mdist::quant::QuantConfig::preset("fp8"),
//       [&](mdist::hf::CausalLM& m) { for (const auto& ids : calib) m->forward(ids); });
//   const at::Tensor loss = model->loss(model->forward(ids), ids);   // the quantized loss
//   quantized.reset();                                                 // the model as before
//
// The quantizers live in the returned ModelQuantizers, not in the model: the model's modules,
// parameters and state dict stay as they are (saving it writes the unquantized weights), and
// the fake quant is applied by forward hooks (mdist/nn/hooks.h) for as long as the object
// lives. So it works on a plain model and on one split or wrapped by hf::apply_parallelism
// alike: the hooks run inside the Linear's call, where FSDP has gathered its weight and tensor
// parallelism has cut it. Its quantizers are named as modelopt names them
// (`model.layers.0.self_attn.q_proj.weight_quantizer`), and amax_state_dict() gives modelopt's
// state-dict keys (`....weight_quantizer._amax`).
//
// Calibration, as modelopt's `max_calibrate`:
//  1. every enabled quantizer goes into calibrate mode; every enabled weight quantizer first
//     sees its weight (`weight_only_quantize`), so a Linear that the loop never reaches still
//     gets its weight amax. A model wrapped by fully_shard holds no whole weight outside its
//     forward: there the weights are taken inside the loop's forwards instead (the same max;
//     with QuantizeOptions::master_weight_amax also from the master shards), and an enabled
//     weight quantizer whose Linear never ran is an Error naming it;
//  2. the forward loop runs (each rank its own data); every enabled quantizer keeps the
//     running max |x| (per row for a per-row weight);
//  3. each quantizer's amax is that max; quantizers that saw nothing (an input no token
//     reached) have none and quantize with their input's own max, as modelopt's;
//  4. the amax is synced (MAX) across ranks, modelopt's rules: every quantizer over the data-
//     parallel group (under expert parallelism a routed expert's quantizers over its expert-
//     data-parallel group instead: the ranks that hold the same expert, under its global name);
//     under tensor parallelism (`parallelism`) over the tensor-parallel group a column-parallel
//     Linear's per-tensor input and weight amax, a row-parallel Linear's per-tensor input and its
//     per-tensor or per-row weight amax. A column-parallel per-row weight amax stays per shard (its
//     rows are this rank's). Unlike modelopt, a quantizer with an amax on some ranks of a group and
//     none on others is synced too (ranks without one count as 0), instead of leaving the ranks to
//     run mismatched collectives;
//  5. every enabled quantizer goes into quantize mode.
// Then forward applies, per Linear, y = linear(input_quantizer(x), weight_quantizer(W), b)
// with the straight-through backward (modelopt's default pass-through).
//
// SmoothQuant (algorithm "smoothquant", modelopt's `smoothquant`): during the loop above each
// Linear also keeps max |x_c| per input channel and max_r |W_rc|; after the sync (those per-
// channel maxima MAX over the data-parallel group, and for a column-parallel Linear over the
// tensor-parallel group; a row-parallel Linear's shards own their channels),
//   s_c = max_r|W_rc|^(1 - alpha) / max|x_c|^alpha   (fp32; channels with max|x_c| <= 2^-31
//                                                     -> 1; clamped to [1e-4, 1e4]),
// the input quantizer's pre_quant_scale is s (in the weights' dtype), the weight becomes
// (W / s) in the weights' dtype (see QuantizedLinear::smoothing), the input amax
// max_c(max|x_c| * s_c) per tensor (MAX over the tensor-parallel group) and the per-row weight
// amax is taken again from the smoothed weight (a row-parallel one MAX over the tensor-parallel
// group). A model wrapped by fully_shard runs the forward loop a second time for that. A
// quantized Linear the loop never reached is an Error (modelopt leaves it unsmoothed).
//
// AWQ-lite (algorithm "awq_lite", modelopt's `awq_lite`, INT4_AWQ_CFG and W4A8_AWQ_BETA_CFG):
// the INT4 Linears get an input pre_quant_scale 1/s chosen by a search over alpha and their weights
// folded as (W * s) in the weights' dtype (QuantizedLinear::smoothing), block amax taken from
// the folded weight; see src/quant/awq.h for the arithmetic and the sync rules. A disabled input
// quantizer still applies its pre_quant_scale, as modelopt's. W4A8 (an FP8 input quantizer and a
// second, FP8 weight stage): the search runs with the inputs unquantized and the weights INT4
// only (modelopt's convert_to_single_quantizer); the input amax is max_c(max|x_c| * p_c), the
// cache pass's per-channel maxima times the pre_quant_scale p, the second stage's amax max |W|
// of the folded weight,
// both MAX over the data- and tensor-parallel groups.
//
// Not covered (Errors, or documented in docs/quantization.md): a tied head whose quantizers the
// configuration enables (the tied head is no Linear module in mdist), calibration algorithms
// other than max and smoothquant, expert parallelism with tensor parallelism.
//
// Mixtures of experts (calibrate, algorithms max and smoothquant): transformers 5 fuses a
// sparse block's routed experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`) and
// modelopt 0.47 quantizes them as one module (`_QuantFusedExperts`): one input quantizer per
// fused projection shared by every expert of the block (`experts.gate_up_proj_input_quantizer`,
// `experts.down_proj_input_quantizer`) and one weight quantizer per expert and fused projection
// (`experts.gate_up_proj_weight_quantizers.E`: gate and up rows in one tensor). mdist's experts
// stay per-expert Linears under the export's names (`experts.E.gate_proj`), and calibrate()
// gives them shared quantizers configured by modelopt's fused names: every expert's gate_proj
// and up_proj of a block share one input quantizer, every down_proj another; an expert's
// gate_proj and up_proj share one weight quantizer where its amax is one number (per tensor,
// NVFP4's global amax; a per-row amax is the rows' own either way). A shared input amax is synced
// over the data-parallel group (the whole world under expert parallelism: the block's experts are
// spread over it); the weight amaxes as each expert's. SmoothQuant leaves the routed experts
// unsmoothed, as modelopt (they are no Linears to it).
//
// KV cache (kv_cache.h): where the config enables them (add_kv_cache_rules), each attention's
// k_bmm_quantizer / v_bmm_quantizer are calibrated with the same max in the same loop, synced
// over the data-parallel group and over the tensor-parallel group (the ranks hold different
// heads), and fake-quantize the keys and values in every forward (generate's cache included).
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mdist/groups/parallel_state.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/hf/parallelize.h"
#include "mdist/nn/hooks.h"
#include "mdist/quant/kv_cache.h"
#include "mdist/quant/quant_config.h"
#include "mdist/quant/tensor_quantizer.h"

namespace mdist::quant {

// Runs calibration data through the model (modelopt's `forward_loop`): forwards only, the
// caller's batches, on this rank's share of the data.
using ForwardLoop = std::function<void(hf::CausalLM& model)>;

struct QuantizeOptions {
  // The groups amax is synced over (data parallel: all; tensor parallel: the rules above).
  ParallelState parallel = ParallelState();
  // How the model is split (hf::apply_parallelism's result): which Linears are column- and
  // row-parallel, whether the routed experts are split over an expert-parallel group. Empty
  // for an unsplit model.
  hf::Parallelism parallelism = hf::Parallelism();
  // Under expert parallelism (parallelism.expert_parallel set): the ranks holding the same
  // experts (mdist::make_expert_data_parallel_group), over which a routed expert's amax is
  // synced. Required then; unused otherwise.
  std::optional<Group> expert_data_parallel = std::nullopt;
  // A model wrapped by fully_shard whose forwards compute in another dtype than its sharded
  // parameters hold (MixedPrecisionPolicy::param_dtype: bf16 compute over fp32 master weights).
  // modelopt's weight_only_quantize gathers each weight whole in its shards' dtype before the
  // forward loop, whose Linears then see the weight in param_dtype, so its weight amax is the
  // max of both, in the wider dtype. When set, calibration (the max and SmoothQuant algorithms'
  // per-tensor and per-row weight quantizers) takes that max too: each rank reduces its own
  // rows of the master shard, MAX over the data-parallel group, no gather. Without it a
  // wrapped model's weight amax comes from its forwards only (the same value when they compute
  // in the parameters' dtype). Not with expert parallelism or static blocks (Error).
  bool master_weight_amax = false;
};

class ModelQuantizers;

// While one is alive, the forwards of this thread feed no calibration statistic that counts
// forwards (AWQ's means and losses): for a forward a rank runs only to keep collectives in step
// with the others (FSDP2's gathers), a sequence that another rank already calibrates on. Max
// calibration still sees it (a maximum is unchanged by a repeat).
class UncountedForward {
 public:
  UncountedForward();
  ~UncountedForward();
  UncountedForward(const UncountedForward&) = delete;
  UncountedForward& operator=(const UncountedForward&) = delete;
};

// Inserts the quantizers `config` enables into `model`, calibrates them on `forward_loop` and
// turns fake quant on. Collective over the groups of `options` (every rank calls it). Throws
// InputError for an algorithm other than "max" and "smoothquant" and Error as described above.
std::unique_ptr<ModelQuantizers> quantize(hf::CausalLM& model, const QuantConfig& config,
                                          const ForwardLoop& forward_loop,
                                          const QuantizeOptions& options = {});

// One quantized Linear: its name, its two quantizers (a disabled quantizer is present, in
// mode disabled, so that the configuration's outcome can be inspected).
struct QuantizedLinear {
  std::string name;  // the Linear's module name, "model.layers.0.mlp.up_proj"
  std::shared_ptr<torch::nn::LinearImpl> linear;
  TensorQuantizer input_quantizer{nullptr};
  TensorQuantizer weight_quantizer{nullptr};
  // modelopt's SequentialQuantizer (W4A8: INT4 blocks, then FP8 per tensor): the second stage,
  // applied to weight_quantizer's output and calibrated on the same weight (its max |W|);
  // null for a single quantizer. Named `weight_quantizer.1` then, weight_quantizer
  // `weight_quantizer.0`, as modelopt's state dict names them.
  TensorQuantizer weight_quantizer_2{nullptr};
  // The weight the Linear held before a quantized forward swapped in its fake-quantized copy.
  at::Tensor saved_weight;
  // The weight the weight quantizers collected from before the forward loop (not under
  // fully_shard) and its version counter: while the Linear still holds that tensor unchanged,
  // the forwards' calibration skips collecting its max again (the same values, the same max).
  at::Tensor collected_weight;
  int64_t collected_version = -1;

  // SmoothQuant (algorithm "smoothquant"). While `collect_channels` is set, every forward
  // keeps the running max |x_c| per input channel (in the input's dtype) and the weight's
  // max_r |W_rc| (its dtype): modelopt's per-channel input calibration (axis -1).
  bool collect_channels = false;
  at::Tensor act_channel_amax;
  at::Tensor weight_channel_amax;
  // 1 / s (fp32, [in_features] of this rank's weight): once set, the weight this Linear
  // quantizes and multiplies is the smoothed (W * smoothing[None, :]).to(W's dtype), as
  // modelopt folds 1 / s into the weight; the input quantizer's pre_quant_scale is s. The
  // model's own parameter stays unsmoothed (it is smoothed in each forward and in export).
  at::Tensor smoothing;
  // The weight amax is taken from the smoothed weight in the next forward (a model wrapped by
  // fully_shard holds its whole weight only there).
  bool weight_amax_pending = false;
};

// modelopt's folding of SmoothQuant's 1 / s into a weight: (W * smoothing[None, :]) computed
// in fp32 (the scale's dtype) and cast back to W's dtype.
at::Tensor smoothed_weight(const at::Tensor& weight, const at::Tensor& smoothing);

// The quantizers of one model and the hooks that apply them; removing the hooks on
// destruction leaves the model as it was. Neither copyable nor movable (the hooks refer to it).
class ModelQuantizers {
 public:
  // Puts quantizers on every Linear of `model` as `config` resolves them (all disabled until
  // set_mode); throws Error when the config enables a tied head's quantizers.
  ModelQuantizers(hf::CausalLM& model, const QuantConfig& config);
  ~ModelQuantizers();
  ModelQuantizers(const ModelQuantizers&) = delete;
  ModelQuantizers& operator=(const ModelQuantizers&) = delete;

  // Calibrate (steps 1-4 above) and switch to quantize mode.
  void calibrate(const ForwardLoop& forward_loop, const QuantizeOptions& options);
  // Every enabled quantizer to `mode` (disabled ones stay disabled).
  void set_mode(TensorQuantizerImpl::Mode mode);

  // Per Linear, in module order.
  const std::vector<std::unique_ptr<QuantizedLinear>>& linears() const { return linears_; }
  // Per attention, in module order: the KV-cache quantizers.
  const std::vector<std::unique_ptr<QuantizedAttention>>& attentions() const { return attentions_; }
  // Every quantizer by its modelopt name ("<linear>.input_quantizer" / ".weight_quantizer",
  // W4A8's ".weight_quantizer.0" / ".weight_quantizer.1", "<attention>.k_bmm_quantizer" /
  // ".v_bmm_quantizer").
  std::map<std::string, TensorQuantizer> quantizers() const;
  // "<quantizer name>._amax" -> amax, for every quantizer that has one (modelopt's keys).
  std::map<std::string, at::Tensor> amax_state_dict() const;

 private:
  void install_hooks(QuantizedLinear& linear);
  void install_hooks(QuantizedAttention& attention);
  void calibrate_weights_directly();
  void collect_master_weight_amax(const QuantizeOptions& options);
  void load_calib_amax(bool weights_from_forward);
  void sync_amax(const QuantizeOptions& options);
  void smooth(const ForwardLoop& forward_loop, const QuantizeOptions& options,
              bool weights_from_forward);
  void calibrate_awq(const ForwardLoop& forward_loop, const QuantizeOptions& options,
                     bool weights_from_forward);
  // The routed experts' quantizers shared as modelopt's fused experts' (see above).
  void share_fused_expert_quantizers();
  bool is_routed_expert(const std::string& linear) const;

  hf::CausalLM model_;
  QuantConfig config_;
  std::vector<std::unique_ptr<QuantizedLinear>> linears_;
  std::vector<std::unique_ptr<QuantizedAttention>> attentions_;
  std::vector<nn::HookHandle> hooks_;
  // Each sparse block's routed experts prefix ("model.layers.0.mlp.experts."), in model order.
  std::vector<std::string> expert_prefixes_;
};

}  // namespace mdist::quant
