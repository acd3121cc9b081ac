// modelopt's TensorQuantizer: modes, max calibration, forward order.
#include "mdist/quant/tensor_quantizer.h"

#include <ATen/ATen.h>

#include <string>
#include <utility>

#include "mdist/error.h"
#include "src/quant/layout.h"

namespace mdist::quant {
namespace {

std::string shape_str(at::IntArrayRef shape) {
  std::string s = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) {
    s += (d ? ", " : "") + std::to_string(shape[d]);
  }
  return s + "]";
}

// modelopt's `reduce_amax`: max(|max x|, |min x|) over `dims` (all when empty), keepdim, a
// one-element result squeezed to 0-d; in x's dtype.
// Both extremes come from one pass (aminmax): the same values as max() and min() apart.
at::Tensor reduce_amax(const at::Tensor& x, bool per_tensor) {
  if (per_tensor) {
    const auto [lowest, highest] = at::aminmax(x);
    return at::maximum(highest.abs(), lowest.abs());
  }
  if (x.dim() == 2) {
    const auto [lowest, highest] = at::aminmax(x, 1, /*keepdim=*/true);
    at::Tensor amax = at::maximum(highest.abs(), lowest.abs());
    if (amax.numel() == 1) amax.squeeze_();
    return amax;
  }
  std::vector<int64_t> dims;
  for (int64_t d = 1; d < x.dim(); ++d) dims.push_back(d);
  at::Tensor amax =
      at::maximum(at::amax(x, dims, /*keepdim=*/true).abs(), at::amin(x, dims, true).abs());
  if (amax.numel() == 1) amax.squeeze_();
  return amax;
}

}  // namespace

TensorQuantizerImpl::TensorQuantizerImpl(QuantFormat format, TensorQuantizerOptions options)
    : format_(std::move(format)), options_(options) {}

void TensorQuantizerImpl::set_amax(const at::Tensor& amax) {
  if (!amax.defined()) throw Error("mdist::quant: amax cannot be set to an undefined tensor");
  const at::NoGradGuard no_grad;
  if (!amax_.defined()) {
    amax_ = register_buffer("_amax", amax.detach().clone());
    return;
  }
  if (amax.sizes() != amax_.sizes()) {
    throw Error("mdist::quant: amax has shape " + shape_str(amax_.sizes()) +
                "; it cannot be set to one of shape " + shape_str(amax.sizes()));
  }
  amax_.copy_(amax.detach());
}

void TensorQuantizerImpl::load_calib_amax() {
  if (!calib_amax_.defined()) {
    throw Error("mdist::quant: load_calib_amax: the " + format_.str() +
                " quantizer has collected nothing (no input reached it in calibrate mode)");
  }
  set_amax(calib_amax_);
}

void TensorQuantizerImpl::set_pre_quant_scale(const at::Tensor& scale) {
  if (!scale.defined()) throw Error("mdist::quant: pre_quant_scale cannot be undefined");
  const at::NoGradGuard no_grad;
  if (!pre_quant_scale_.defined()) {
    pre_quant_scale_ = register_buffer("_pre_quant_scale", scale.detach().clone());
    return;
  }
  if (scale.sizes() != pre_quant_scale_.sizes()) {
    throw Error("mdist::quant: pre_quant_scale has shape " + shape_str(pre_quant_scale_.sizes()) +
                "; it cannot be set to one of shape " + shape_str(scale.sizes()));
  }
  pre_quant_scale_.copy_(scale.detach());
}

void TensorQuantizerImpl::collect(const at::Tensor& x) {
  const at::NoGradGuard no_grad;
  // Static blocks are rows here (modelopt's axis (0,) after the reshape).
  const bool per_tensor =
      format_.axis() == Axis::per_tensor && format_.block_kind() != BlockKind::static_blocks;
  collect_amax(reduce_amax(x.detach(), per_tensor));
}

void TensorQuantizerImpl::collect_amax(const at::Tensor& local) {
  const at::NoGradGuard no_grad;
  // MaxCalibrator asserts these: a NaN or an infinity would poison every later batch's max.
  if (local.isnan().any().item<bool>()) {
    throw Error("mdist::quant: calibration of the " + format_.str() +
                " quantizer met NaN in its input");
  }
  if (local.isinf().any().item<bool>()) {
    throw Error("mdist::quant: calibration of the " + format_.str() +
                " quantizer met an infinite value in its input");
  }
  if (!calib_amax_.defined()) {
    calib_amax_ = local;
    return;
  }
  if (local.sizes() != calib_amax_.sizes()) {
    throw Error("mdist::quant: calibration of the " + format_.str() + " quantizer: amax shape " +
                shape_str(local.sizes()) + " differs from the earlier batches' " +
                shape_str(calib_amax_.sizes()));
  }
  calib_amax_ = at::maximum(calib_amax_, local);
}

at::Tensor TensorQuantizerImpl::forward(const at::Tensor& input) {
  if (input.numel() == 0) return input;
  const at::Tensor x = pre_quant_scale_.defined() ? input * pre_quant_scale_ : input;
  if (mode_ == Mode::disabled) return x;

  const bool blocked = format_.block_kind() == BlockKind::static_blocks;
  if (blocked) {
    if (x.dim() == 0)
      throw Error("mdist::quant: " + format_.str() + " needs a tensor, not a scalar");
    if (block_input_shape_.empty()) {
      block_input_shape_ = x.sizes().vec();
    } else if (x.sizes() != at::IntArrayRef(block_input_shape_)) {
      throw Error("mdist::quant: " + format_.str() + " quantizer: the input shape changed from " +
                  shape_str(block_input_shape_) + " to " + shape_str(x.sizes()) +
                  "; block quantization keeps the shape of its first input");
    }
  }
  const at::Tensor layout = blocked ? detail::to_blocks(x, format_.block_size()) : x;

  if (mode_ == Mode::calibrate) {
    collect(layout);
    return x;
  }
  at::Tensor amax = amax_;
  if (!amax.defined()) {
    const at::NoGradGuard no_grad;
    amax = reduce_amax(layout.detach(), format_.axis() == Axis::per_tensor && !blocked);
  }
  const Backward backward = options_.pass_through_bwd ? Backward::pass_through : Backward::clipped;
  return fake_quant_ste(x, amax, format_, backward);
}

}  // namespace mdist::quant
