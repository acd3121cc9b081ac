#pragma once
// Static blocks along the last dim, laid out as modelopt's TensorQuantizer lays them out
// (`_setup_for_blockquant`, `_process_for_blockquant`, `_reset_to_original_shape`): each row
// padded with zeros to whole blocks, then viewed as [blocks, block]. Shared by fake_quant.cpp
// and tensor_quantizer.cpp (calibration collects over the same blocks).
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace mdist::quant::detail {

inline int64_t padding_to_blocks(int64_t n, int64_t block) { return (block - n % block) % block; }

inline at::Tensor to_blocks(const at::Tensor& x, int64_t block) {
  const int64_t pad = padding_to_blocks(x.size(-1), block);
  const at::Tensor padded = pad == 0 ? x : at::constant_pad_nd(x, {0, pad}, 0.0);
  return padded.reshape({-1, block});
}

// The inverse: back to x's padded shape, the padding sliced off.
inline at::Tensor from_blocks(const at::Tensor& blocks, at::IntArrayRef x_shape, int64_t block) {
  std::vector<int64_t> padded = x_shape.vec();
  const int64_t n = padded.back();
  padded.back() = n + padding_to_blocks(n, block);
  const at::Tensor y = blocks.reshape(padded);
  return padded.back() == n ? y : y.narrow(-1, 0, n);
}

}  // namespace mdist::quant::detail
