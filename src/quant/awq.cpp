// modelopt 0.47's AWQ-lite calibration: see src/quant/awq.h.
#include "src/quant/awq.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "mdist/error.h"
#include "mdist/nn/hooks.h"
#include "mdist/tp/collectives.h"

namespace mdist::quant::detail {
namespace {

using Mode = TensorQuantizerImpl::Mode;

// UncountedForward's depth on this thread.
thread_local int uncounted_depth = 0;

// torch.finfo(dtype).tiny of a float dtype.
double tiny(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16:
      return static_cast<double>(std::numeric_limits<c10::BFloat16>::min());
    case at::kHalf:
      return static_cast<double>(std::numeric_limits<c10::Half>::min());
    case at::kDouble:
      return std::numeric_limits<double>::min();
    default:
      return static_cast<double>(std::numeric_limits<float>::min());
  }
}

// modelopt's alpha grid, torch.arange(0, 1.0 + 0.1, 0.1): fp32 values, used as Python floats.
std::vector<double> alpha_grid() {
  const at::Tensor grid = at::arange(0.0, 1.0 + 0.1, 0.1, at::TensorOptions().dtype(at::kFloat));
  std::vector<double> alphas;
  for (int64_t i = 0; i < grid.numel(); ++i) alphas.push_back(grid[i].item<double>());
  return alphas;
}

// What AWQ-lite keeps for one Linear (modelopt's AWQLiteHelper).
struct AwqState {
  QuantizedLinear* q = nullptr;
  bool column_parallel = false;
  bool row_parallel = false;
  int64_t block = 0;
  at::Tensor act_scale;     // fp32 [in]: sum over the cache forwards, then their mean
  at::Tensor weight_scale;  // fp32 [in]
  int64_t cache_steps = 0;
  int64_t search_steps = 0;
  std::vector<at::Tensor> loss;    // fp32 [], one per alpha
  std::vector<at::Tensor> scales;  // fp32 [in], the candidate scale of each alpha
  bool enabled = true;
  bool input_quantized = false;  // its input quantizer was enabled (W4A8)
  at::Tensor act_amax;           // W4A8: max |x_c| per input channel, in x's dtype
};

// get_weight_scale: mean over rows of |W| / (block max |W| + tiny), in W's dtype, then fp32.
// The caller has checked that the block size divides in_features.
at::Tensor weight_scale(const at::Tensor& weight, int64_t block) {
  const at::Tensor w = weight.detach().contiguous().view({-1, block}).abs();
  const at::Tensor block_max = w.amax({1}, /*keepdim=*/true);
  const at::Tensor scale = (w / (block_max + tiny(weight.scalar_type()))).view(weight.sizes());
  return scale.mean({0}).to(at::kFloat);
}

// get_act_scale: mean over tokens of |x_c|, in x's dtype, then fp32.
at::Tensor act_scale(const at::Tensor& x) {
  return x.detach().abs().contiguous().view({-1, x.size(-1)}).mean({0}).to(at::kFloat);
}

bool group_used(const DistributedProcessGroup& group) {
  return group.is_initialized() && group.group().is_member() && group.world_size() > 1;
}

// get_scale: the candidate scale of one alpha (fp32 [in]); a column-parallel Linear's is
// averaged over the tensor-parallel group (SUM, then / tp, as modelopt; every rank holds the
// same one, see awq.h). A row-parallel Linear's shard holds some of the input channels: the
// normalisation takes the max and min over all of them (MAX over the tensor-parallel group),
// so that each rank holds its part of the one-rank scale.
at::Tensor candidate_scale(const AwqState& state, double alpha, const QuantizeOptions& options) {
  at::Tensor s = (state.act_scale.pow(alpha) /
                  (state.weight_scale.to(state.act_scale.device()).pow(1.0 - alpha) +
                   static_cast<double>(std::numeric_limits<float>::min())))
                     .clamp(1e-4, 1e4)
                     .view({-1});
  const auto& tp = options.parallel.tensor_parallel_group;
  at::Tensor max = s.max(), min = s.min();
  if (state.row_parallel && group_used(tp)) {
    at::Tensor bounds = at::stack({max, -min});
    tp::all_reduce_(bounds, tp.group(), "max");
    max = bounds[0];
    min = -bounds[1];
  }
  s = (s / (max * min).sqrt()).view({-1});
  if (state.column_parallel && group_used(tp)) {
    tp::all_reduce_(s, tp.group(), "sum");
    s = s / static_cast<double>(tp.world_size());
  }
  return s;
}

// One search forward: modelopt's QuantLinear with input pre_quant_scale 1/s and weight
// pre_quant_scale s, its weight fake-quantized with each block's own max, against the
// unquantized output.
// A row-parallel Linear's outputs are partial sums over its input channels (its bias is
// added after the all-reduce, outside this call): summed over the tensor-parallel group, the
// loss is that of the Linear's whole output, as on one rank (and as modelopt's, whose
// row-parallel forward includes the reduction).
void search_step(AwqState& state, const at::Tensor& x, const QuantizeOptions& options) {
  const auto& linear = *state.q->linear;
  const at::Tensor weight = linear.weight.detach();
  const auto dtype = weight.scalar_type();
  const c10::optional<at::Tensor> bias =
      linear.bias.defined() ? c10::optional<at::Tensor>(linear.bias.detach()) : c10::nullopt;
  const auto& tp = options.parallel.tensor_parallel_group;
  const bool reduce = state.row_parallel && group_used(tp);
  const auto whole = [&](at::Tensor partial) {
    if (reduce) tp::all_reduce_(partial, tp.group(), "sum");
    return partial;
  };
  const at::Tensor actual = whole(at::linear(x, weight, bias).contiguous());
  for (std::size_t i = 0; i < state.scales.size(); ++i) {
    const at::Tensor& s = state.scales[i];
    TensorQuantizer dynamic(state.q->weight_quantizer->format());
    const at::Tensor fake_weight = dynamic(weight * s.to(dtype));
    const at::Tensor out =
        whole(at::linear(x * s.reciprocal().to(dtype), fake_weight, bias).contiguous());
    state.loss[i] += (out - actual).to(at::kFloat).pow(2).mean().to(state.loss[i].device());
  }
  ++state.search_steps;
}

// SUM (op "sum") or MAX over `group` of tensors packed into one fp32 buffer, in place.
void all_reduce(std::vector<at::Tensor>& tensors, const DistributedProcessGroup& group,
                const char* op) {
  if (tensors.empty() || !group_used(group)) return;
  std::vector<at::Tensor> flat;
  for (const auto& t : tensors) flat.push_back(t.to(at::kFloat).reshape({-1}));
  at::Tensor buffer = at::cat(flat).contiguous();
  tp::all_reduce_(buffer, group.group(), op);
  int64_t offset = 0;
  for (auto& t : tensors) {
    const int64_t n = t.numel();
    t = buffer.narrow(0, offset, n).view(t.sizes()).to(t.scalar_type()).clone();
    offset += n;
  }
}

// modelopt's max_calibrate(linear, weight_quantizer(weight)): the block amax taken from
// `weight`, then quantizing; a SequentialQuantizer's second stage (W4A8's FP8) from the same
// weight (awq's "special handling for SequentialQuantizer").
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

}  // namespace

}  // namespace mdist::quant::detail

namespace mdist::quant {

UncountedForward::UncountedForward() { ++detail::uncounted_depth; }
UncountedForward::~UncountedForward() { --detail::uncounted_depth; }

}  // namespace mdist::quant

namespace mdist::quant::detail {

void check_awq_blocks(const std::vector<QuantizedLinear*>& linears) {
  for (const QuantizedLinear* q : linears) {
    const QuantFormat& format = q->weight_quantizer->format();
    if (format.block_kind() != BlockKind::static_blocks) {
      throw Error("mdist::quant: AWQ-lite needs static weight blocks; " + q->name +
                  "'s weight is quantized as " + format.str());
    }
    const int64_t in = q->linear->weight.size(1);
    if (in % format.block_size() != 0) {
      throw InputError("mdist::quant: AWQ: " + q->name + " has in_features " + std::to_string(in) +
                       ", which the block size " + std::to_string(format.block_size()) +
                       " does not divide");
    }
  }
}

void awq_lite(hf::CausalLM& model, const std::vector<QuantizedLinear*>& linears,
              const std::vector<bool>& column_parallel, const std::vector<bool>& row_parallel,
              const ForwardLoop& forward_loop, const QuantizeOptions& options,
              bool weights_from_forward) {
  if (!forward_loop) throw InputError("mdist::quant: AWQ needs a forward loop (calibration data)");
  check_awq_blocks(linears);
  const std::vector<double> alphas = alpha_grid();
  std::vector<std::unique_ptr<AwqState>> states;
  for (std::size_t i = 0; i < linears.size(); ++i) {
    auto state = std::make_unique<AwqState>();
    state->q = linears[i];
    state->column_parallel = column_parallel.at(i);
    state->row_parallel = row_parallel.at(i);
    state->block = linears[i]->weight_quantizer->format().block_size();
    // modelopt takes it when the helper is made; a model wrapped by fully_shard holds its
    // whole weight only in its forwards, where the hook takes it instead.
    if (!weights_from_forward) {
      state->weight_scale = weight_scale(linears[i]->linear->weight, state->block);
    }
    // The search's weights are fake-quantized with their blocks' own max: no amax yet; only
    // the first stage of a SequentialQuantizer (modelopt's convert_to_single_quantizer).
    linears[i]->weight_quantizer->set_mode(Mode::disabled);
    if (linears[i]->weight_quantizer_2) linears[i]->weight_quantizer_2->set_mode(Mode::disabled);
    // A quantized input (W4A8's FP8) is calibrated per channel in the cache pass (modelopt's
    // axis -1) and stays unquantized in the search (modelopt's AWQLiteHelper.setup).
    state->input_quantized = linears[i]->input_quantizer->is_enabled();
    if (state->input_quantized) linears[i]->input_quantizer->set_mode(Mode::disabled);
    states.push_back(std::move(state));
  }

  // 1. Cache pass.
  bool searching = false;
  std::vector<nn::HookHandle> hooks;
  for (auto& owned : states) {
    AwqState* state = owned.get();
    hooks.push_back(nn::register_forward_pre_hook(
        *state->q->linear,
        [state, &searching, &options](torch::nn::Module&, nn::TensorRefs& inputs) {
          if (inputs.empty() || inputs.front()->numel() == 0 || !state->enabled) return;
          const at::NoGradGuard no_grad;
          const at::Tensor& x = *inputs.front();
          // A model wrapped by fully_shard holds its whole weight only here.
          if (!searching && !state->weight_scale.defined()) {
            state->weight_scale = weight_scale(state->q->linear->weight, state->block);
          }
          // The per-channel input max (a repeated forward does not change a maximum).
          if (!searching && state->input_quantized) {
            std::vector<int64_t> dims(static_cast<std::size_t>(x.dim() - 1));
            std::iota(dims.begin(), dims.end(), 0);
            const at::Tensor amax = at::amax(x.detach().abs(), dims);
            state->act_amax = state->act_amax.defined() ? at::maximum(state->act_amax, amax) : amax;
          }
          if (uncounted_depth > 0) return;
          if (searching) {
            search_step(*state, x.detach(), options);
            return;
          }
          const at::Tensor act = act_scale(x);
          state->act_scale = state->act_scale.defined() ? state->act_scale + act : act;
          ++state->cache_steps;
        }));
  }
  const auto remove_hooks = [&hooks] {
    for (auto& hook : hooks) hook.remove();
    hooks.clear();
  };
  try {
    forward_loop(model);

    // The mean over every rank's cache forwards: the sums and counts summed over the
    // data-parallel group (modelopt averages the ranks' means, the same value when the ranks
    // ran as many forwards; see awq.h). A NaN turns AWQ off for the Linear on every rank.
    const c10::Device device =
        linears.empty() ? c10::Device(c10::kCPU) : linears.front()->linear->weight.device();
    std::vector<at::Tensor> sums;
    for (auto& state : states) {
      const int64_t in = state->q->linear->weight.size(1);
      const at::Tensor count = at::full({1}, static_cast<double>(state->cache_steps),
                                        at::TensorOptions().device(device));
      const at::Tensor act = state->cache_steps > 0
                                 ? state->act_scale.to(device)
                                 : at::zeros({in}, at::TensorOptions().device(device));
      sums.push_back(at::cat({act, count}));
    }
    const auto& dp = options.parallel.data_parallel_group;
    all_reduce(sums, dp, "sum");
    // The per-channel input maxima: MAX over the data-parallel group (max_calibrate's sync);
    // a rank that saw no token sends zeros. A Linear no rank reached keeps none.
    std::vector<at::Tensor> act_amax;
    for (auto& state : states) {
      if (!state->input_quantized) continue;
      const int64_t in = state->q->linear->weight.size(1);
      act_amax.push_back(state->act_amax.defined()
                             ? at::cat({state->act_amax.to(device).to(at::kFloat),
                                        at::ones({1}, at::TensorOptions().device(device))})
                             : at::zeros({in + 1}, at::TensorOptions().device(device)));
    }
    all_reduce(act_amax, dp, "max");
    std::size_t quantized_input = 0;
    for (auto& state : states) {
      if (!state->input_quantized) continue;
      const at::Tensor& amax = act_amax[quantized_input++];
      const int64_t in = state->q->linear->weight.size(1);
      const auto dtype = state->act_amax.defined() ? state->act_amax.scalar_type()
                                                   : state->q->linear->weight.scalar_type();
      state->act_amax =
          amax[in].item<double>() > 0 ? amax.narrow(0, 0, in).to(dtype) : at::Tensor();
    }
    // A column-parallel Linear holds some of the weight's rows: w is their mean over all rows
    // (row sums and row counts summed over the tensor-parallel group), the one-rank statistic,
    // where modelopt averages the shards' candidate scales (see awq.h).
    std::vector<at::Tensor> row_sums;
    for (auto& state : states) {
      if (!state->column_parallel) continue;
      const int64_t in = state->q->linear->weight.size(1);
      const auto rows = static_cast<double>(state->q->linear->weight.size(0));
      row_sums.push_back(state->weight_scale.defined()
                             ? at::cat({state->weight_scale.to(device) * rows,
                                        at::full({1}, rows, at::TensorOptions().device(device))})
                             : at::zeros({in + 1}, at::TensorOptions().device(device)));
    }
    all_reduce(row_sums, options.parallel.tensor_parallel_group, "sum");
    std::size_t column = 0;
    for (auto& state : states) {
      if (!state->column_parallel) continue;
      const at::Tensor& sum = row_sums[column++];
      const int64_t in = state->q->linear->weight.size(1);
      if (state->weight_scale.defined() && group_used(options.parallel.tensor_parallel_group)) {
        state->weight_scale = sum.narrow(0, 0, in) / sum[in];
      }
    }
    for (std::size_t i = 0; i < states.size(); ++i) {
      AwqState& state = *states[i];
      const int64_t in = state.q->linear->weight.size(1);
      const double count = sums[i][in].item<double>();
      if (count == 0 || !state.weight_scale.defined()) {
        state.enabled = false;
        continue;
      }
      state.act_scale = sums[i].narrow(0, 0, in) / count;
      if (state.act_scale.isnan().any().item<bool>() ||
          state.weight_scale.isnan().any().item<bool>()) {
        state.enabled = false;
        continue;
      }
      for (std::size_t a = 0; a < alphas.size(); ++a) {
        state.loss.push_back(at::zeros({}, at::TensorOptions().device(device).dtype(at::kFloat)));
        state.scales.push_back(candidate_scale(state, alphas[a], options));
      }
    }

    // 2. Search pass.
    searching = true;
    forward_loop(model);
    remove_hooks();

    // The losses summed over the ranks, so that all choose the same alpha (see awq.h).
    std::vector<at::Tensor> losses;
    // modelopt turns AWQ off for a Linear the search pass missed; here on every rank alike.
    std::vector<at::Tensor> searched;
    for (auto& state : states) {
      searched.push_back(at::full({1}, static_cast<double>(state->search_steps),
                                  at::TensorOptions().device(device)));
    }
    all_reduce(searched, dp, "sum");
    for (std::size_t i = 0; i < states.size(); ++i) {
      if (searched[i].item<double>() == 0) states[i]->enabled = false;
    }
    for (auto& state : states) {
      losses.push_back(state->enabled ? at::stack(state->loss)
                                      : at::zeros({static_cast<int64_t>(alphas.size())},
                                                  at::TensorOptions().device(device)));
    }
    all_reduce(losses, dp, "sum");
    all_reduce(losses, options.parallel.tensor_parallel_group, "sum");

    // 3. The best alpha's scale folded into the weight.
    for (std::size_t i = 0; i < states.size(); ++i) {
      AwqState& state = *states[i];
      QuantizedLinear& q = *state.q;
      const auto dtype = q.linear->weight.scalar_type();
      q.weight_quantizer->set_mode(Mode::quantize);
      if (q.weight_quantizer_2) q.weight_quantizer_2->set_mode(Mode::quantize);
      if (state.input_quantized) q.input_quantizer->set_mode(Mode::quantize);
      // W4A8's input amax (modelopt's postprocess and apply_pre_quant_scale_and_smooth): the
      // max over channels of max|x_c| (in W's dtype) times the fp32 pre_quant_scale, in W's
      // dtype; on the fallback the unsmoothed max.
      const auto set_input_amax = [&](const at::Tensor& pre_quant_scale) {
        if (!state.input_quantized || !state.act_amax.defined()) return;
        const at::Tensor act = state.act_amax.to(dtype);
        q.input_quantizer->set_amax((pre_quant_scale.defined()
                                         ? (act * pre_quant_scale.to(act.device())).amax()
                                         : act.amax())
                                        .to(dtype));
      };
      if (state.enabled) {
        // min() over the losses as Python floats: the first smallest wins.
        std::size_t best = 0;
        for (std::size_t a = 1; a < alphas.size(); ++a) {
          if (losses[i][static_cast<int64_t>(a)].item<double>() <
              losses[i][static_cast<int64_t>(best)].item<double>()) {
            best = a;
          }
        }
        const at::Tensor pre_quant_scale = state.scales[best].reciprocal();
        q.input_quantizer->set_pre_quant_scale(pre_quant_scale.to(dtype));
        set_input_amax(pre_quant_scale);
        q.smoothing = pre_quant_scale.reciprocal();
      } else {
        set_input_amax(at::Tensor());
        q.input_quantizer->set_pre_quant_scale(
            at::ones({q.linear->weight.size(1)}, q.linear->weight.options().dtype(dtype)));
      }
      if (weights_from_forward) {
        q.weight_amax_pending = true;
      } else {
        const at::Tensor weight = q.smoothing.defined()
                                      ? smoothed_weight(q.linear->weight.detach(), q.smoothing)
                                      : q.linear->weight.detach();
        recalibrate(q, weight);
      }
    }
  } catch (...) {
    remove_hooks();
    throw;
  }
  if (weights_from_forward) {
    // A third pass takes each folded weight's block amax in its first forward.
    forward_loop(model);
    for (const QuantizedLinear* q : linears) {
      if (q->weight_amax_pending) {
        throw Error("mdist::quant: AWQ: " + q->name + " did not run in the last calibration pass");
      }
    }
  }
}

}  // namespace mdist::quant::detail
