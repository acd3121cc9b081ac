#pragma once
// modelopt's TensorQuantizer (`quantization/nn/modules/tensor_quantizer.py`) as a
// torch::nn::Module: a format, a mode, an amax buffer filled by max calibration, an optional
// pre_quant_scale, and a forward in modelopt's order. Its buffers carry modelopt's names
// (`_amax`, `_pre_quant_scale`), so that a quantizer registered on a Linear as
// `weight_quantizer` / `input_quantizer` gives `weight_quantizer._amax` in the state dict as
// modelopt does. Like modelopt, a buffer exists only once it has a value.
//
//   mdist::quant::TensorQuantizer q(mdist::quant::QuantFormat::int8_per_row());
//   q->set_mode(mdist::quant::TensorQuantizerImpl::Mode::calibrate);
//   for (const auto& w : batches) q(w);         // running max |w| per row; returns w
//   q->load_calib_amax();                        // _amax = that max, shape [rows, 1]
//   q->set_mode(mdist::quant::TensorQuantizerImpl::Mode::quantize);
//   at::Tensor y = q(w);                         // fake-quantized, STE backward
//
// Not here yet (see docs/quantization.md): insertion into models, the calibration algorithms
// beyond max (SmoothQuant, AWQ), distributed amax sync, export.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <vector>

#include "mdist/quant/fake_quant.h"
#include "mdist/quant/format.h"

namespace mdist::quant {

struct TensorQuantizerOptions {
  // modelopt's `pass_through_bwd`, whose default in 0.47 is true: the gradient passes through
  // unchanged. False gives the clipped STE (zero where |x| > amax).
  bool pass_through_bwd = true;
};

class TensorQuantizerImpl : public torch::nn::Module {
 public:
  // quantize: fake quant (modelopt's `_if_quant`, the default); calibrate: collect the running
  // max and return the input (`_if_calib` with quantization off, as `max_calibrate` sets it);
  // disabled: return the input after the pre_quant_scale (`_disabled`).
  enum class Mode { quantize, calibrate, disabled };

  explicit TensorQuantizerImpl(QuantFormat format, TensorQuantizerOptions options = {});

  // modelopt's order: an empty input is returned as it is (an expert without tokens);
  // x *= pre_quant_scale; disabled -> x; static blocks: x padded and viewed in blocks;
  // calibrate -> collect, return x; quantize -> fake quant with the STE, back in x's shape.
  // Without an amax buffer the quantize mode uses the input's own max, as modelopt's
  // `_get_amax` does.
  at::Tensor forward(const at::Tensor& x);

  const QuantFormat& format() const { return format_; }
  const TensorQuantizerOptions& options() const { return options_; }
  Mode mode() const { return mode_; }
  void set_mode(Mode mode) { mode_ = mode; }
  bool is_enabled() const { return mode_ != Mode::disabled; }

  // The `_amax` buffer: undefined until set or loaded. set_amax registers it the first time
  // (a copy of `amax`, in its dtype) and copies into it afterwards; a different shape is an
  // Error, as in modelopt.
  const at::Tensor& amax() const { return amax_; }
  bool has_amax() const { return amax_.defined(); }
  void set_amax(const at::Tensor& amax);
  // modelopt's `load_calib_amax` with the max calibrator: _amax = the running max collected in
  // calibrate mode. Error when nothing was collected.
  void load_calib_amax();
  // Merges a maximum taken elsewhere (in the shape collect's reduction gives, e.g. from the
  // shards of a weight that no rank holds whole) into the running max, as collect merges a
  // batch's; the running max takes the wider dtype of the two (torch.max's promotion). Error on
  // NaN, an infinity or another shape.
  void collect_amax(const at::Tensor& amax);
  // The running max so far (undefined before the first batch), and forgetting it.
  const at::Tensor& calib_amax() const { return calib_amax_; }
  void reset_calibration() { calib_amax_ = at::Tensor(); }

  // The `_pre_quant_scale` buffer (SmoothQuant / AWQ), multiplied into the input first.
  const at::Tensor& pre_quant_scale() const { return pre_quant_scale_; }
  void set_pre_quant_scale(const at::Tensor& scale);

 private:
  // modelopt's MaxCalibrator.collect on the (blocked) input: max |x| reduced over every dim
  // but the quantization axis, kept in x's dtype.
  void collect(const at::Tensor& x);

  QuantFormat format_;
  TensorQuantizerOptions options_;
  Mode mode_ = Mode::quantize;
  at::Tensor amax_;
  at::Tensor pre_quant_scale_;
  at::Tensor calib_amax_;
  // Static blocks: the first input's shape. modelopt fixes the block layout on the first call
  // and refuses another shape afterwards; so does this.
  std::vector<int64_t> block_input_shape_;
};
TORCH_MODULE(TensorQuantizer);

}  // namespace mdist::quant
