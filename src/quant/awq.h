#pragma once
// Private: modelopt 0.47's AWQ-lite (`model_calib.awq_lite`) on the Linears of a
// ModelQuantizers, called by its calibrate() for the algorithm "awq_lite" (INT4_AWQ_CFG).
//
// Per Linear whose weight quantizer is enabled (static INT4 blocks):
//  1. cache pass (the forward loop): act_c = mean over tokens of |x_c| (in x's dtype, then
//     fp32), summed over the forwards and divided by their number; w_c = mean over rows of
//     |W| / (its block's max |W| + tiny(dtype)) (in W's dtype, then fp32). Forwards under an
//     UncountedForward are not counted (here nor in the search);
//  2. search pass (the loop again): for every alpha in arange(0, 1.1, 0.1) (fp32 values)
//       s = clamp(act^alpha / (w^(1 - alpha) + tiny(fp32)), 1e-4, 1e4);  s /= sqrt(max s * min s)
//     (a column-parallel Linear's s: SUM / tp over the tensor-parallel group), and the loss
//     mean((linear(x * (1/s), fq(W * s)) - linear(x, W))^2) in fp32, fq with each block's own
//     max (no amax yet), accumulated over the forwards;
//  3. the smallest loss wins (the first alpha on ties); the input quantizer's pre_quant_scale
//     is p = 1 / s (fp32, stored in W's dtype), the weight is folded, (W * (1 / p)) in W's
//     dtype, and its block amax taken again from the folded weight.
// A Linear the cache pass never reached, whose statistics hold a NaN, or that the search pass
// missed is max-calibrated unfolded with a pre_quant_scale of ones (modelopt's fallback).
//
// W4A8 (an enabled per-tensor input quantizer, a second weight stage): the cache pass also
// keeps max |x_c| per input channel (in x's dtype; MAX over the data-parallel group), the
// input quantizer is off in the search (modelopt's AWQLiteHelper.setup and
// convert_to_single_quantizer: inputs unquantized, weights INT4 only); afterwards its amax is
// max_c(max|x_c| * p_c) with the fp32 pre_quant_scale p, in W's dtype
// (apply_pre_quant_scale_and_smooth; the fallback: max_c max|x_c|), and the second stage's
// amax is taken from the folded weight like the first's.
//
// Deliberate differences: act is the mean over all ranks' forwards (sums and counts summed
// over the data-parallel group), where modelopt averages each rank's mean: equal when the ranks
// run as many forwards, and independent of the layout otherwise. The losses are summed over the
// data- and tensor-parallel groups before the choice, so that every rank picks the same alpha
// (modelopt lets each rank choose from its own data, which can leave ranks with different weights).
// Under tensor parallelism the statistics are the one-rank ones, so that the result does not
// depend on the layout (up to the summation order of the split forward): a column-parallel
// Linear's w is the mean over all rows (modelopt averages the candidate scales its shards
// compute from their own rows, then SUM / tp); a row-parallel Linear's candidate scale is
// normalised by the max and min over all its input channels (modelopt: over the shard's) and
// its search loss is that of the all-reduced output (as modelopt's Megatron row-parallel
// forward; mdist's Linear returns a partial sum before its all-reduce hook).
#include <vector>

#include "mdist/quant/quantize.h"

namespace mdist::quant::detail {

// Runs both passes of `forward_loop` (three on a model wrapped by fully_shard: the folded
// weights' amax is taken in a third pass) and leaves every participating Linear with its
// smoothing and pre_quant_scale set and its weight quantizer in quantize mode with an amax.
// Collective over the groups of `options`. Throws InputError for a Linear whose in_features the
// block size does not divide.
// `column_parallel[i]`: linears[i] is split by output rows under tensor parallelism;
// `row_parallel[i]`: by input columns.
void awq_lite(hf::CausalLM& model, const std::vector<QuantizedLinear*>& linears,
              const std::vector<bool>& column_parallel, const std::vector<bool>& row_parallel,
              const ForwardLoop& forward_loop, const QuantizeOptions& options,
              bool weights_from_forward);

// The Linears AWQ needs whole blocks from: an InputError naming the first one whose
// in_features the weight's block size does not divide. Called before any calibration.
void check_awq_blocks(const std::vector<QuantizedLinear*>& linears);

}  // namespace mdist::quant::detail
