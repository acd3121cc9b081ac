#pragma once
// Quantization formats of modelopt's TensorQuantizer (NVIDIA Model Optimizer 0.47,
// `QuantizerAttributeConfig`): an integer or float element format, the granularity of its
// amax (per tensor, per output row, static blocks along the last dim) and NVFP4's dynamic
// blocks.
//
//   const auto w = mdist::quant::QuantFormat::int4_blocks();      // INT4_AWQ_CFG's weights
//   const auto x = mdist::quant::QuantFormat::fp8();              // FP8_DEFAULT_CFG's inputs
//
// Every QuantFormat is valid: the factories and with_* refuse, with an mdist::Error naming the
// problem, what modelopt's fake quant cannot compute (another float format than E4M3 and E2M1,
// E2M1 outside NVFP4's dynamic blocks, blocks together with a per-row axis).
//
// A last dimension that the block size does not divide is not an error, as in modelopt: static
// blocks pad each row with zeros to a whole block (`_setup_for_blockquant`) and slice the
// padding off after quantizing; NVFP4's kernel reads the tail of a row as zeros likewise.
#include <cstdint>
#include <string>

namespace mdist::quant {

// Which elements share one amax, outside blocks: all of them, or each index of dim 0 (a
// Linear weight's output rows: modelopt's `axis: 0`).
enum class Axis { per_tensor, per_row };

// none; static: one amax per `block_size` consecutive elements of the last dim, calibrated
// (INT4 AWQ: 128); dynamic: NVFP4's per-16 block scales computed at run time from the data,
// in E4M3, under a calibrated per-tensor global amax.
enum class BlockKind { none, static_blocks, dynamic_blocks };

class QuantFormat {
 public:
  // Integer: `num_bits` in [2, 16]; modelopt's defaults are signed and not narrow range
  // (the range is [-2^(b-1), 2^(b-1) - 1]; narrow: [-(2^(b-1) - 1), 2^(b-1) - 1]; unsigned:
  // [0, 2^b - 1]).
  static QuantFormat integer(int num_bits, bool is_unsigned = false, bool narrow_range = false);
  // Float (exponent bits, mantissa bits): only (4, 3), E4M3, has a fake quant of its own in
  // modelopt; E2M1 exists only as nvfp4().
  static QuantFormat floating(int exponent_bits, int mantissa_bits);

  // modelopt's presets.
  static QuantFormat fp8() { return floating(4, 3); }  // FP8_DEFAULT_CFG
  static QuantFormat int8() { return integer(8); }     // INT8 inputs
  static QuantFormat int8_per_row() {                  // INT8_DEFAULT_CFG weights
    return integer(8).with_axis(Axis::per_row);
  }
  static QuantFormat int4_blocks(std::int64_t block_size = 128) {  // INT4_AWQ_CFG weights
    return integer(4).with_static_blocks(block_size);
  }
  // NVFP4_DEFAULT_CFG: E2M1 in dynamic blocks of 16 with E4M3 scales.
  static QuantFormat nvfp4();

  QuantFormat with_axis(Axis axis) const;
  QuantFormat with_static_blocks(std::int64_t block_size) const;

  bool is_integer() const { return exponent_bits_ == 0; }
  bool is_float() const { return exponent_bits_ != 0; }
  bool is_e4m3() const { return exponent_bits_ == 4 && mantissa_bits_ == 3; }
  bool is_nvfp4() const { return block_kind_ == BlockKind::dynamic_blocks; }
  // Integer bits; 1 + exponent + mantissa for floats.
  int num_bits() const { return num_bits_; }
  int exponent_bits() const { return exponent_bits_; }
  int mantissa_bits() const { return mantissa_bits_; }
  bool is_unsigned() const { return unsigned_; }
  bool narrow_range() const { return narrow_range_; }
  Axis axis() const { return axis_; }
  BlockKind block_kind() const { return block_kind_; }
  // 0 without blocks.
  std::int64_t block_size() const { return block_size_; }

  // modelopt's `TensorQuantizer.maxbound`: 448 for E4M3, 6 for E2M1 with E4M3 scales,
  // 2^(bits - 1 + unsigned) - 1 for integers.
  double maxbound() const;
  // For messages: "int8 per-row", "e4m3 per-tensor", "int4 static blocks of 128",
  // "nvfp4 (e2m1, dynamic blocks of 16, e4m3 scales)".
  std::string str() const;

  bool operator==(const QuantFormat&) const = default;

 private:
  QuantFormat() = default;

  int num_bits_ = 8;
  int exponent_bits_ = 0;
  int mantissa_bits_ = 0;
  bool unsigned_ = false;
  bool narrow_range_ = false;
  Axis axis_ = Axis::per_tensor;
  BlockKind block_kind_ = BlockKind::none;
  std::int64_t block_size_ = 0;
};

}  // namespace mdist::quant
