// quant::quantize: quantizers on every Linear of an hf::CausalLM through forward hooks,
// modelopt 0.47's max calibration and amax sync, then fake quant in forward.
#include "mdist/quant/quantize.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "mdist/error.h"
#include "mdist/fsdp/fully_shard.h"
#include "mdist/fsdp/state_dict.h"
#include "mdist/hf/expert_parallel.h"
#include "mdist/quant/block_check.h"
#include "mdist/runtime/device.h"
#include "mdist/tp/collectives.h"
#include "src/quant/amax_sync.h"
#include "src/quant/awq.h"

namespace mdist::quant {
namespace {

using Mode = TensorQuantizerImpl::Mode;

// modelopt registers its quantized modules under these class names (QuantModuleRegistry);
// parent_class rules compare against them. Every quantizer here belongs to a Linear.
constexpr const char* kLinearClass = "nn.Linear";
// transformers 5's fused experts module (modelopt's _QuantFusedExperts): no class that a
// preset's parent_class rule names.
constexpr const char* kFusedExpertsClass = "fused experts";

TensorQuantizer make_quantizer(const ResolvedQuantizer& resolved, bool pass_through_bwd) {
  TensorQuantizer quantizer(resolved.format,
                            TensorQuantizerOptions{.pass_through_bwd = pass_through_bwd});
  // An enabled quantizer starts as modelopt's does after set_quantizer_by_cfg: quantizing,
  // with no amax yet (its input's own max).
  quantizer->set_mode(resolved.enabled ? Mode::quantize : Mode::disabled);
  return quantizer;
}

// A tied head computes logits with embed_tokens.weight inside CausalLM's forward: there is no
// Linear to hook. modelopt quantizes transformers' lm_head Linear only if a rule enables it
// (every preset disables "*lm_head*"), so only such a configuration is refused.
void check_tied_head(const hf::CausalLM& model, const QuantConfig& config) {
  if (model->lm_head) return;
  for (const auto role : {QuantizerRole::input, QuantizerRole::weight}) {
    const std::string name =
        role == QuantizerRole::input ? "lm_head.input_quantizer" : "lm_head.weight_quantizer";
    if (config.resolve(name, kLinearClass, role).enabled) {
      throw Error("mdist::quant: the configuration '" + config.name + "' enables " + name +
                  ", but this model's head is tied to embed_tokens and cannot be quantized");
    }
  }
}

// Which way tensor parallelism splits a Linear (its weight's placement in the plan).
enum class TpSplit { none, column, row };

TpSplit tp_split(const hf::Parallelism& parallelism, const std::string& linear) {
  if (!parallelism.tensor_parallel_split()) return TpSplit::none;
  switch (parallelism.tensor_parallel->placement(linear + ".weight").split) {
    case hf::TensorParallelPlacement::Split::kRows:
      return TpSplit::column;
    case hf::TensorParallelPlacement::Split::kColumns:
      return TpSplit::row;
    case hf::TensorParallelPlacement::Split::kReplicated:
      break;
  }
  return TpSplit::none;
}

// modelopt's TP rule (max_calibrate, sync_quantizer_amax_across_tp): column-parallel syncs
// input and weight amax of axis None (or -1, which no preset uses); row-parallel the input of
// axis None and the weight of axis None or 0. Static blocks are never synced.
bool syncs_over_tp(TpSplit split, QuantizerRole role, const QuantFormat& format) {
  if (split == TpSplit::none || format.block_kind() == BlockKind::static_blocks) return false;
  const bool per_tensor = format.axis() == Axis::per_tensor;
  if (split == TpSplit::column || role == QuantizerRole::input) return per_tensor;
  return true;  // a row-parallel weight, per tensor or per output row
}

// SmoothQuant's statistics of one forward: max |x_c| over every dim but the last (modelopt's
// input calibration with axis -1), and max_r |W_rc|, each a running max in its dtype.
void collect_channels(QuantizedLinear& q, const at::Tensor& x) {
  if (x.numel() == 0) return;
  const at::NoGradGuard no_grad;
  std::vector<int64_t> dims;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) dims.push_back(d);
  const at::Tensor xd = x.detach();
  const at::Tensor act = at::maximum(at::amax(xd, dims).abs(), at::amin(xd, dims).abs());
  if (act.isnan().any().item<bool>() || act.isinf().any().item<bool>()) {
    throw Error("mdist::quant: SmoothQuant calibration of " + q.name +
                " met NaN or an infinite value in its input");
  }
  const at::Tensor weight = at::amax(q.linear->weight.detach().abs(), {0});
  q.act_channel_amax = q.act_channel_amax.defined() ? at::maximum(q.act_channel_amax, act) : act;
  q.weight_channel_amax = weight;  // the same weight in every forward
}

// modelopt's `max_calibrate(linear, lambda l: l.weight_quantizer(l.weight))` after smoothing:
// the amax taken again from `weight` (a SequentialQuantizer's stages both from the weight, as
// in calibrate mode each returns its input).
void recalibrate(TensorQuantizer& quantizer, const at::Tensor& weight) {
  quantizer->set_mode(Mode::calibrate);
  quantizer(weight);
  quantizer->load_calib_amax();
  quantizer->reset_calibration();
  quantizer->set_mode(Mode::quantize);
}

void recalibrate(QuantizedLinear& q, const at::Tensor& weight) {
  recalibrate(q.weight_quantizer, weight);
  if (q.weight_quantizer_2) recalibrate(q.weight_quantizer_2, weight);
}

// MAX all-reduce of several tensors over `group`, in place (packed in fp32, which holds the
// values of the narrower float dtypes exactly). Every rank passes the same shapes.
void all_reduce_max(const std::vector<at::Tensor*>& tensors, const DistributedProcessGroup& group) {
  if (tensors.empty() || !group.is_initialized() || !group.group().is_member() ||
      group.world_size() <= 1) {
    return;
  }
  std::vector<at::Tensor> parts;
  for (const at::Tensor* t : tensors) parts.push_back(t->detach().to(at::kFloat).reshape({-1}));
  at::Tensor buffer = at::cat(parts).contiguous();
  tp::all_reduce_(buffer, group.group(), "max");
  int64_t offset = 0;
  for (at::Tensor* t : tensors) {
    const int64_t n = t->numel();
    *t = buffer.narrow(0, offset, n).view(t->sizes()).to(t->scalar_type()).clone();
    offset += n;
  }
}

}  // namespace

at::Tensor smoothed_weight(const at::Tensor& weight, const at::Tensor& smoothing) {
  return (weight * smoothing.to(weight.device()).unsqueeze(0)).to(weight.scalar_type());
}

ModelQuantizers::ModelQuantizers(hf::CausalLM& model, const QuantConfig& config)
    : model_(model), config_(config) {
  check_tied_head(model_, config_);
  if (const auto problem = block_size_problem(model_, config_)) {
    throw InputError("mdist::quant: " + *problem);
  }
  if (config_.algorithm == "awq_lite" && model_->config.moe) {
    // modelopt 0.47 sees transformers 5's fused experts as no Linears (as for SmoothQuant).
    throw InputError(
        "mdist::quant: AWQ on a mixture of experts is not supported yet (modelopt quantizes "
        "its fused experts in a way mdist's per-expert layers do not reproduce)");
  }
  for (const auto& [prefix, experts] : hf::named_experts(model_)) {
    expert_prefixes_.push_back(prefix + ".");
  }
  for (const auto& item : model_->named_modules("", /*include_self=*/false)) {
    auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(item.value());
    if (!linear) continue;
    auto quantized = std::make_unique<QuantizedLinear>();
    quantized->name = item.key();
    quantized->linear = std::move(linear);
    quantized->input_quantizer = make_quantizer(
        config_.resolve(item.key() + ".input_quantizer", kLinearClass, QuantizerRole::input),
        config_.pass_through_bwd);
    const ResolvedQuantizer weight =
        config_.resolve(item.key() + ".weight_quantizer", kLinearClass, QuantizerRole::weight);
    quantized->weight_quantizer = make_quantizer(weight, config_.pass_through_bwd);
    if (weight.second_format) {
      quantized->weight_quantizer_2 =
          make_quantizer(ResolvedQuantizer{*weight.second_format, weight.enabled, std::nullopt},
                         config_.pass_through_bwd);
    }
    install_hooks(*quantized);
    linears_.push_back(std::move(quantized));
  }
  attentions_ = detail::make_quantized_attentions(model_, config_);
  for (const auto& attention : attentions_) install_hooks(*attention);
  // Here rather than in calibrate(): quantizers whose amax is set from a saved state (a QAT
  // run resumed, mdist train's qat_quantizers.safetensors) are shared as the calibrated ones.
  // The hooks read q.input_quantizer / weight_quantizer when they run, so sharing after
  // installing them is fine.
  share_fused_expert_quantizers();
}

ModelQuantizers::~ModelQuantizers() {
  for (auto& hook : hooks_) hook.remove();
  // A forward that threw mid-way has restored its weight in the error hook; nothing else can
  // still hold a swapped weight here.
}

void ModelQuantizers::install_hooks(QuantizedLinear& q) {
  // The pre-hook runs inside the Linear's call: after FSDP's pre-hooks (registered when the
  // model was wrapped, before these) have gathered the weight, and on tensor parallelism's
  // local part of it. modelopt's QuantLinear: input_quantizer(x), weight_quantizer(W).
  hooks_.push_back(
      nn::register_forward_pre_hook(*q.linear, [&q](torch::nn::Module&, nn::TensorRefs& inputs) {
        if (inputs.empty()) return;
        if (q.collect_channels) collect_channels(q, *inputs.front());
        // A disabled input quantizer with a pre_quant_scale (INT4 AWQ's weight-only layers)
        // still scales the input, as modelopt's TensorQuantizer does before its disabled check.
        if (q.input_quantizer->is_enabled() || q.input_quantizer->pre_quant_scale().defined()) {
          *inputs.front() = q.input_quantizer(*inputs.front());
        }
        if (!q.weight_quantizer->is_enabled()) return;
        const bool second = q.weight_quantizer_2 && q.weight_quantizer_2->is_enabled();
        if (q.weight_quantizer->mode() == Mode::calibrate) {
          const at::Tensor& w = q.linear->weight;
          if (q.collected_weight.defined() && w.is_same(q.collected_weight) &&
              w._version() == q.collected_version) {
            return;  // this max was collected from these very values already
          }
          q.weight_quantizer(w);  // collects; the weight stays as it is
          if (second) q.weight_quantizer_2(q.linear->weight);
          return;
        }
        // The fake-quantized weight replaces the Linear's member (not its registered
        // parameter) for this call only; the hooks below put the original back.
        q.saved_weight = q.linear->weight;
        const at::Tensor weight =
            q.smoothing.defined() ? smoothed_weight(q.saved_weight, q.smoothing) : q.saved_weight;
        if (q.weight_amax_pending) {
          recalibrate(q, weight);
          q.weight_amax_pending = false;
        }
        q.linear->weight =
            second ? q.weight_quantizer_2(q.weight_quantizer(weight)) : q.weight_quantizer(weight);
      }));
  const auto restore = [&q] {
    if (!q.saved_weight.defined()) return;
    q.linear->weight = std::move(q.saved_weight);
    q.saved_weight = at::Tensor();
  };
  hooks_.push_back(nn::register_forward_hook(
      *q.linear, [restore](torch::nn::Module&, nn::TensorRefs&) { restore(); }));
  hooks_.push_back(
      nn::register_forward_error_hook(*q.linear, [restore](torch::nn::Module&) { restore(); }));
}

// modelopt's `_QuantAttention._quantized_attention`: k_bmm_quantizer(keys),
// v_bmm_quantizer(values), through the attention's hook points (hf::AttentionImpl).
void ModelQuantizers::install_hooks(QuantizedAttention& a) {
  const auto hook = [](TensorQuantizer& quantizer) {
    return [&quantizer](torch::nn::Module&, nn::TensorRefs& inputs) {
      if (!inputs.empty() && quantizer->is_enabled()) *inputs.front() = quantizer(*inputs.front());
    };
  };
  hooks_.push_back(nn::register_forward_pre_hook(*a.attention->k_bmm, hook(a.k_bmm_quantizer)));
  hooks_.push_back(nn::register_forward_pre_hook(*a.attention->v_bmm, hook(a.v_bmm_quantizer)));
}

void ModelQuantizers::set_mode(Mode mode) {
  for (const auto& q : linears_) {
    for (auto* quantizer : {&q->input_quantizer, &q->weight_quantizer, &q->weight_quantizer_2}) {
      if (*quantizer && (*quantizer)->is_enabled()) (*quantizer)->set_mode(mode);
    }
  }
  for (const auto& a : attentions_) {
    for (auto* quantizer : {&a->k_bmm_quantizer, &a->v_bmm_quantizer}) {
      if ((*quantizer)->is_enabled()) (*quantizer)->set_mode(mode);
    }
  }
}

std::map<std::string, TensorQuantizer> ModelQuantizers::quantizers() const {
  std::map<std::string, TensorQuantizer> all;
  for (const auto& q : linears_) {
    all.emplace(q->name + ".input_quantizer", q->input_quantizer);
    if (q->weight_quantizer_2) {
      all.emplace(q->name + ".weight_quantizer.0", q->weight_quantizer);
      all.emplace(q->name + ".weight_quantizer.1", q->weight_quantizer_2);
    } else {
      all.emplace(q->name + ".weight_quantizer", q->weight_quantizer);
    }
  }
  for (const auto& a : attentions_) {
    all.emplace(a->name + ".k_bmm_quantizer", a->k_bmm_quantizer);
    all.emplace(a->name + ".v_bmm_quantizer", a->v_bmm_quantizer);
  }
  return all;
}

std::map<std::string, at::Tensor> ModelQuantizers::amax_state_dict() const {
  std::map<std::string, at::Tensor> amax;
  for (const auto& [name, quantizer] : quantizers()) {
    if (quantizer->has_amax()) amax.emplace(name + "._amax", quantizer->amax());
  }
  return amax;
}

// modelopt's weight_only_quantize: every enabled weight quantizer sees its Linear's weight,
// whether or not the forward loop will reach the Linear.
void ModelQuantizers::calibrate_weights_directly() {
  for (const auto& q : linears_) {
    if (q->weight_quantizer->is_enabled()) q->weight_quantizer(q->linear->weight);
    if (q->weight_quantizer_2 && q->weight_quantizer_2->is_enabled()) {
      q->weight_quantizer_2(q->linear->weight);
    }
    q->collected_weight = q->linear->weight;
    q->collected_version = static_cast<int64_t>(q->linear->weight._version());
  }
}

// modelopt's weight_only_quantize on a model wrapped by fully_shard under mixed precision
// (QuantizeOptions::master_weight_amax): max |W| of each weight in its master dtype, per tensor
// or per output row. FSDP2 shards along dim 0, the rows: each rank reduces its own rows (a
// per-row amax of rows it does not hold is 0, which a MAX leaves alone), then the maxima are
// MAX-reduced over the data-parallel group and merged into the running max the forward loop
// continues with the gathered weights.
void ModelQuantizers::collect_master_weight_amax(const QuantizeOptions& options) {
  if (options.parallelism.expert_parallel) {
    throw Error("mdist::quant: master_weight_amax does not support expert parallelism yet");
  }
  const auto placements = param_placements(*model_);
  std::vector<detail::AmaxToSync> masters;
  std::vector<TensorQuantizer> targets;
  const at::NoGradGuard no_grad;
  for (const auto& q : linears_) {
    for (const TensorQuantizer& quantizer : {q->weight_quantizer, q->weight_quantizer_2}) {
      if (!quantizer || !quantizer->is_enabled()) continue;
      const QuantFormat& format = quantizer->format();
      if (format.block_kind() == BlockKind::static_blocks) {
        throw Error("mdist::quant: master_weight_amax does not support static blocks (" + q->name +
                    ")");
      }
      const auto found = placements.find(q->name + ".weight");
      if (found == placements.end()) {
        throw Error("mdist::quant: " + q->name + ".weight is no parameter of the wrapped model");
      }
      const ParamPlacement& placement = found->second;
      const at::Tensor rows = placement.param.detach().narrow(0, 0, placement.rows).abs();
      at::Tensor amax;
      if (format.axis() == Axis::per_row) {
        // The [rows, 1] shape (0-d for one row) that collect's reduction gives.
        amax = at::zeros({placement.full_shape[0], 1}, rows.options());
        if (placement.rows > 0) {
          amax.narrow(0, placement.row_offset, placement.rows)
              .copy_(at::amax(rows, {1}, /*keepdim=*/true));
        }
        if (amax.numel() == 1) amax.squeeze_();
      } else {
        amax = placement.rows > 0 ? rows.max() : at::zeros({}, rows.options());
      }
      TensorQuantizer master(format);
      master->set_amax(amax);
      masters.push_back({q->name + ".weight_quantizer", master});
      targets.push_back(quantizer);
    }
  }
  // Where the forwards compute (the shards may live on the CPU under CPU offload).
  const c10::Device device = compute_device();
  detail::sync_amax_max(masters, options.parallel.data_parallel_group, device);
  for (std::size_t i = 0; i < masters.size(); ++i) {
    targets[i]->collect_amax(masters[i].quantizer->amax().to(device));
  }
}

// modelopt's finish_stats_collection with the max calibrator: amax = the collected max.
void ModelQuantizers::load_calib_amax(bool weights_from_forward) {
  for (const auto& q : linears_) {
    if (q->input_quantizer->is_enabled() && q->input_quantizer->calib_amax().defined()) {
      q->input_quantizer->load_calib_amax();
    }
    if (!q->weight_quantizer->is_enabled()) continue;
    if (!q->weight_quantizer->calib_amax().defined() && weights_from_forward) {
      throw Error("mdist::quant: " + q->name +
                  " never ran in the calibration loop; the weights of a model wrapped by "
                  "fully_shard are calibrated in its forwards, so every quantized Linear must run");
    }
    q->weight_quantizer->load_calib_amax();
    if (q->weight_quantizer_2 && q->weight_quantizer_2->is_enabled()) {
      q->weight_quantizer_2->load_calib_amax();
    }
  }
  for (const auto& q : linears_) {
    q->collected_weight = at::Tensor();
    q->collected_version = -1;
    q->input_quantizer->reset_calibration();
    q->weight_quantizer->reset_calibration();
    if (q->weight_quantizer_2) q->weight_quantizer_2->reset_calibration();
  }
  // Keys and values an attention never saw (no forward ran) keep no amax, as an input's.
  for (const auto& a : attentions_) {
    for (auto* quantizer : {&a->k_bmm_quantizer, &a->v_bmm_quantizer}) {
      if ((*quantizer)->is_enabled() && (*quantizer)->calib_amax().defined()) {
        (*quantizer)->load_calib_amax();
      }
      (*quantizer)->reset_calibration();
    }
  }
}

void ModelQuantizers::sync_amax(const QuantizeOptions& options) {
  // The packed buffer lives where the Linears compute (their weights' device; FSDP's full
  // parameters are on the compute device).
  const c10::Device device =
      linears_.empty() ? c10::Device(c10::kCPU) : linears_.front()->linear->weight.device();
  // Under expert parallelism the ranks hold different routed experts (under their global
  // names): each expert's weight amax is synced over the ranks that hold it; a block's shared
  // expert input quantizers (share_fused_expert_quantizers) and everything else over data
  // parallel, which spans the expert-parallel groups. A quantizer shared by several Linears is
  // synced once, where its first Linear comes in module order (the same place on every rank:
  // each rank holds some experts of every block).
  const bool expert_parallel = options.parallelism.expert_parallel != nullptr;
  std::set<const TensorQuantizerImpl*> seen;
  std::vector<detail::AmaxToSync> all, over_tp, over_edp;
  for (const auto& q : linears_) {
    const TpSplit split = tp_split(options.parallelism, q->name);
    const bool expert = expert_parallel && is_routed_expert(q->name);
    for (const auto role : {QuantizerRole::input, QuantizerRole::weight}) {
      const TensorQuantizer& quantizer =
          role == QuantizerRole::input ? q->input_quantizer : q->weight_quantizer;
      if (!quantizer->is_enabled() || !seen.insert(quantizer.get()).second) continue;
      const std::string name =
          q->name + (role == QuantizerRole::input ? ".input_quantizer" : ".weight_quantizer");
      (expert && role == QuantizerRole::weight ? over_edp : all).push_back({name, quantizer});
      if (syncs_over_tp(split, role, quantizer->format())) over_tp.push_back({name, quantizer});
    }
    if (q->weight_quantizer_2 && q->weight_quantizer_2->is_enabled()) {
      const std::string name = q->name + ".weight_quantizer.1";
      all.push_back({name, q->weight_quantizer_2});
      if (syncs_over_tp(split, QuantizerRole::weight, q->weight_quantizer_2->format())) {
        over_tp.push_back({name, q->weight_quantizer_2});
      }
    }
  }
  // KV-cache quantizers: per tensor, MAX over data parallel and over the tensor-parallel
  // group, whose ranks hold different heads (modelopt syncs every per-tensor amax over TP).
  for (const auto& a : attentions_) {
    for (const auto* role : {"k_bmm_quantizer", "v_bmm_quantizer"}) {
      const TensorQuantizer& quantizer =
          std::string_view(role) == "k_bmm_quantizer" ? a->k_bmm_quantizer : a->v_bmm_quantizer;
      if (!quantizer->is_enabled()) continue;
      all.push_back({a->name + "." + role, quantizer});
      if (options.parallelism.tensor_parallel_split()) {
        over_tp.push_back({a->name + "." + role, quantizer});
      }
    }
  }
  detail::sync_amax_max(all, options.parallel.data_parallel_group, device);
  if (!over_edp.empty()) {
    detail::sync_amax_max(over_edp, DistributedProcessGroup(*options.expert_data_parallel), device);
  }
  detail::sync_amax_max(over_tp, options.parallel.tensor_parallel_group, device);
}

void ModelQuantizers::calibrate(const ForwardLoop& forward_loop, const QuantizeOptions& options) {
  const bool smoothquant = config_.algorithm == "smoothquant";
  const bool awq = config_.algorithm == "awq_lite";
  if (config_.algorithm != "max" && !smoothquant && !awq) {
    throw InputError("mdist::quant: calibration algorithm '" + config_.algorithm +
                     "' is not supported (only 'max', 'smoothquant' and 'awq_lite')");
  }
  // modelopt's SmoothQuantCalibConfig.alpha: ge=0, le=1 (NaN fails both).
  const double alpha = config_.smoothquant_alpha;
  if (smoothquant && !(alpha >= 0.0 && alpha <= 1.0)) {
    throw InputError("mdist::quant: SmoothQuant alpha " + std::to_string(alpha) +
                     " is outside [0, 1] (modelopt's SmoothQuantCalibConfig.alpha)");
  }
  if (options.parallelism.expert_parallel &&
      (options.parallelism.tensor_parallel_split() || !options.expert_data_parallel)) {
    throw Error(
        "mdist::quant: quantize: an expert-parallel model needs QuantizeOptions::"
        "expert_data_parallel, and cannot be tensor-parallel too (not supported yet)");
  }
  const bool weights_from_forward = is_fsdp2_model(*model_);
  if (smoothquant && !forward_loop) {
    throw InputError("mdist::quant: SmoothQuant needs a forward loop (calibration data)");
  }
  if (awq) {
    calibrate_awq(forward_loop, options, weights_from_forward);
    return;
  }
  for (const auto& q : linears_) {
    q->collect_channels = smoothquant && q->input_quantizer->is_enabled() &&
                          q->weight_quantizer->is_enabled() && !is_routed_expert(q->name);
  }
  set_mode(Mode::calibrate);
  if (!weights_from_forward) calibrate_weights_directly();
  if (weights_from_forward && options.master_weight_amax) collect_master_weight_amax(options);
  if (forward_loop) forward_loop(model_);
  for (const auto& q : linears_) q->collect_channels = false;
  load_calib_amax(weights_from_forward);
  sync_amax(options);
  set_mode(Mode::quantize);
  if (smoothquant) smooth(forward_loop, options, weights_from_forward);
}

// modelopt's awq_lite on every Linear with an enabled weight quantizer (src/quant/awq.h).
void ModelQuantizers::calibrate_awq(const ForwardLoop& forward_loop, const QuantizeOptions& options,
                                    bool weights_from_forward) {
  std::vector<QuantizedLinear*> linears;
  std::vector<bool> column_parallel, row_parallel;
  for (const auto& q : linears_) {
    if (!q->weight_quantizer->is_enabled()) continue;
    const QuantFormat& input = q->input_quantizer->format();
    if (q->input_quantizer->is_enabled() &&
        (input.axis() != Axis::per_tensor || input.block_kind() != BlockKind::none)) {
      // modelopt turns AWQ off for such a Linear (an input axis other than None / -1).
      throw InputError("mdist::quant: AWQ with inputs quantized as " + input.str() + " (" +
                       q->name + ") is not supported; only per-tensor input quantizers are");
    }
    linears.push_back(q.get());
    column_parallel.push_back(tp_split(options.parallelism, q->name) == TpSplit::column);
    row_parallel.push_back(tp_split(options.parallelism, q->name) == TpSplit::row);
  }
  detail::awq_lite(model_, linears, column_parallel, row_parallel, forward_loop, options,
                   weights_from_forward);
  // W4A8: the per-tensor input amax (of the smoothed input) and the second weight stage's
  // (max |W| of the folded weight), MAX over the groups, modelopt's max_calibrate sync; a
  // row-parallel Linear's shards see different input channels and weight columns.
  std::vector<detail::AmaxToSync> all, over_tp;
  for (QuantizedLinear* q : linears) {
    const TpSplit split = tp_split(options.parallelism, q->name);
    if (q->input_quantizer->is_enabled()) {
      all.push_back({q->name + ".input_quantizer", q->input_quantizer});
      if (split != TpSplit::none) over_tp.push_back(all.back());
    }
    if (q->weight_quantizer_2 && q->weight_quantizer_2->is_enabled()) {
      all.push_back({q->name + ".weight_quantizer.1", q->weight_quantizer_2});
      if (split != TpSplit::none) over_tp.push_back(all.back());
    }
  }
  const c10::Device device =
      linears_.empty() ? c10::Device(c10::kCPU) : linears_.front()->linear->weight.device();
  detail::sync_amax_max(all, options.parallel.data_parallel_group, device);
  detail::sync_amax_max(over_tp, options.parallel.tensor_parallel_group, device);
}

// modelopt's smoothquant `postprocess` and `apply_pre_quant_scale_and_smooth`, per Linear
// whose input and weight quantizers are both 8-bit integers (modelopt skips the others).
void ModelQuantizers::smooth(const ForwardLoop& forward_loop, const QuantizeOptions& options,
                             bool weights_from_forward) {
  const double alpha = config_.smoothquant_alpha;
  std::vector<QuantizedLinear*> smoothed;
  for (const auto& q : linears_) {
    if (!q->input_quantizer->is_enabled() || !q->weight_quantizer->is_enabled()) continue;
    const QuantFormat& x = q->input_quantizer->format();
    const QuantFormat& w = q->weight_quantizer->format();
    if (!x.is_integer() || x.num_bits() != 8 || !w.is_integer() || w.num_bits() != 8) continue;
    // modelopt's SmoothQuant smooths nn.Linear modules; transformers 5's fused experts are none.
    if (is_routed_expert(q->name)) continue;
    if (!q->act_channel_amax.defined()) {
      throw Error("mdist::quant: SmoothQuant: " + q->name +
                  " never ran in the calibration loop; its input has no per-channel maximum");
    }
    smoothed.push_back(q.get());
  }
  // The per-channel maxima: MAX over the data-parallel group (max_calibrate's sync of an
  // axis -1 input amax), and for a column-parallel Linear over the tensor-parallel group too
  // (its rows, so max_r |W_rc|, are split; its input is whole on every rank).
  std::vector<at::Tensor*> over_dp, over_tp;
  for (QuantizedLinear* q : smoothed) {
    over_dp.push_back(&q->act_channel_amax);
    if (tp_split(options.parallelism, q->name) == TpSplit::column) {
      over_tp.push_back(&q->act_channel_amax);
      over_tp.push_back(&q->weight_channel_amax);
    }
  }
  all_reduce_max(over_dp, options.parallel.data_parallel_group);
  all_reduce_max(over_tp, options.parallel.tensor_parallel_group);

  std::vector<detail::AmaxToSync> input_over_tp, weight_over_tp;
  for (QuantizedLinear* q : smoothed) {
    const at::NoGradGuard no_grad;
    const auto dtype = q->linear->weight.scalar_type();
    const at::Tensor act = q->act_channel_amax.to(at::kFloat);
    // The weight's maximum in its dtype, raised to 1 - alpha there; the division by the fp32
    // activation maximum promotes to fp32.
    at::Tensor s = q->weight_channel_amax.to(act.device()).pow(1.0 - alpha) / act.pow(alpha);
    constexpr double kEpsilon = 1.0 / static_cast<double>(int64_t{1} << 31);
    if (s.min().item<double>() <= kEpsilon) s = at::where(act <= kEpsilon, at::ones_like(s), s);
    s = s.clamp(1e-4, 1e4);
    if (!(s > 0).all().item<bool>()) {
      throw Error("mdist::quant: SmoothQuant: " + q->name + " got a non-positive smoothing scale");
    }
    q->input_quantizer->set_pre_quant_scale(s.to(dtype));
    q->smoothing = s.reciprocal();
    q->input_quantizer->set_amax((act.to(dtype) * s).amax().to(dtype));
    const TpSplit split = tp_split(options.parallelism, q->name);
    if (split != TpSplit::none) {
      input_over_tp.push_back({q->name + ".input_quantizer", q->input_quantizer});
    }
    if (split == TpSplit::row) {
      weight_over_tp.push_back({q->name + ".weight_quantizer", q->weight_quantizer});
    }
    if (weights_from_forward) {
      q->weight_amax_pending = true;
    } else {
      recalibrate(*q, smoothed_weight(q->linear->weight, q->smoothing));
    }
  }
  const c10::Device device =
      linears_.empty() ? c10::Device(c10::kCPU) : linears_.front()->linear->weight.device();
  detail::sync_amax_max(input_over_tp, options.parallel.tensor_parallel_group, device);
  if (weights_from_forward) {
    // The whole weights exist only inside the forwards of a fully_shard model: a second pass
    // of the loop takes each smoothed weight's amax in its first forward.
    forward_loop(model_);
    for (QuantizedLinear* q : smoothed) {
      if (q->weight_amax_pending) {
        throw Error("mdist::quant: SmoothQuant: " + q->name +
                    " did not run in the second calibration pass");
      }
    }
  }
  // A row-parallel per-row weight amax: MAX over the input-channel shards.
  detail::sync_amax_max(weight_over_tp, options.parallel.tensor_parallel_group, device);
  for (QuantizedLinear* q : smoothed) {
    q->act_channel_amax = at::Tensor();
    q->weight_channel_amax = at::Tensor();
  }
}

bool ModelQuantizers::is_routed_expert(const std::string& linear) const {
  return std::any_of(expert_prefixes_.begin(), expert_prefixes_.end(),
                     [&linear](const std::string& prefix) { return linear.starts_with(prefix); });
}

// modelopt's _QuantFusedExperts on mdist's per-expert Linears ("<prefix>E.gate_proj"): each
// shared role gets one quantizer, configured as modelopt configures it, by its fused name
// (per-expert weight quantizers "gate_up_proj_weight_quantizers.E" match the rules as
// "gate_up_proj_weight_quantizer", modelopt's _normalize_fused_experts_quantizer_name; the
// experts module is no nn.Linear to parent_class rules). Shared objects calibrate as one: their
// running max covers every expert's inputs, or an expert's gate and up weights.
void ModelQuantizers::share_fused_expert_quantizers() {
  const auto make = [&](const std::string& name, QuantizerRole role) {
    return make_quantizer(config_.resolve(name, kFusedExpertsClass, role),
                          config_.pass_through_bwd);
  };
  for (const std::string& prefix : expert_prefixes_) {
    const TensorQuantizer gate_up_input =
        make(prefix + "gate_up_proj_input_quantizer", QuantizerRole::input);
    const TensorQuantizer down_input =
        make(prefix + "down_proj_input_quantizer", QuantizerRole::input);
    std::map<std::string, TensorQuantizer> gate_up_weight;  // expert index -> its quantizer
    for (const auto& q : linears_) {
      if (!q->name.starts_with(prefix)) continue;
      const std::string rest = q->name.substr(prefix.size());  // "E.gate_proj"
      const std::string expert = rest.substr(0, rest.find('.'));
      const bool down = rest.substr(rest.find('.') + 1) == "down_proj";
      q->input_quantizer = down ? down_input : gate_up_input;
      q->weight_quantizer_2 = TensorQuantizer{nullptr};
      const std::string weight_name =
          prefix + (down ? "down_proj" : "gate_up_proj") + "_weight_quantizer";
      // One amax for the expert's [2I, H] gate and up rows where it is one number (per
      // tensor, NVFP4's global amax); a per-row amax is each projection's own rows either way.
      const TensorQuantizer weight = make(weight_name, QuantizerRole::weight);
      const QuantFormat& format = weight->format();
      if (down || format.axis() != Axis::per_tensor ||
          format.block_kind() == BlockKind::static_blocks) {
        q->weight_quantizer = weight;
      } else {
        q->weight_quantizer = gate_up_weight.emplace(expert, weight).first->second;
      }
    }
  }
}

std::unique_ptr<ModelQuantizers> quantize(hf::CausalLM& model, const QuantConfig& config,
                                          const ForwardLoop& forward_loop,
                                          const QuantizeOptions& options) {
  auto quantizers = std::make_unique<ModelQuantizers>(model, config);
  quantizers->calibrate(forward_loop, options);
  return quantizers;
}

}  // namespace mdist::quant
