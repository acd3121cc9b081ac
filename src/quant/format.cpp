// Quantization formats: validation, maxbound, names.
#include "mdist/quant/format.h"

#include <string>

#include "mdist/error.h"

namespace mdist::quant {

QuantFormat QuantFormat::integer(int num_bits, bool is_unsigned, bool narrow_range) {
  // Below 2 bits the signed range has no positive level (maxbound 0: a division by zero in the
  // scale); above 16 the levels stop being exact in the fp32 arithmetic of the fake quant.
  if (num_bits < 2 || num_bits > 16) {
    throw Error("mdist::quant: integer formats have 2 to 16 bits, not " + std::to_string(num_bits));
  }
  QuantFormat format;
  format.num_bits_ = num_bits;
  format.unsigned_ = is_unsigned;
  format.narrow_range_ = narrow_range;
  return format;
}

QuantFormat QuantFormat::floating(int exponent_bits, int mantissa_bits) {
  const std::string name =
      "E" + std::to_string(exponent_bits) + "M" + std::to_string(mantissa_bits);
  if (exponent_bits == 2 && mantissa_bits == 1) {
    throw Error(
        "mdist::quant: E2M1 is quantized only in NVFP4's dynamic blocks of 16 with E4M3 "
        "scales: use QuantFormat::nvfp4()");
  }
  if (exponent_bits != 4 || mantissa_bits != 3) {
    throw Error("mdist::quant: float format " + name +
                " is not supported (modelopt's fake quant has E4M3 and, in NVFP4, E2M1)");
  }
  QuantFormat format;
  format.exponent_bits_ = exponent_bits;
  format.mantissa_bits_ = mantissa_bits;
  format.num_bits_ = 1 + exponent_bits + mantissa_bits;
  return format;
}

QuantFormat QuantFormat::nvfp4() {
  QuantFormat format;
  format.exponent_bits_ = 2;
  format.mantissa_bits_ = 1;
  format.num_bits_ = 4;
  format.block_kind_ = BlockKind::dynamic_blocks;
  // modelopt's Triton kernel always works in blocks of 16 (its wrapper does not pass the
  // configured size on), so 16 is the only size there is.
  format.block_size_ = 16;
  return format;
}

QuantFormat QuantFormat::with_axis(Axis axis) const {
  if (axis == Axis::per_row && block_kind_ != BlockKind::none) {
    throw Error("mdist::quant: " + str() +
                " cannot also be per-row: blocks and an axis are exclusive (as in modelopt)");
  }
  QuantFormat format = *this;
  format.axis_ = axis;
  return format;
}

QuantFormat QuantFormat::with_static_blocks(std::int64_t block_size) const {
  if (block_kind_ == BlockKind::dynamic_blocks) {
    throw Error("mdist::quant: NVFP4's blocks are dynamic; it has no static blocks");
  }
  if (axis_ == Axis::per_row) {
    throw Error("mdist::quant: " + str() +
                " cannot also have blocks: blocks and an axis are exclusive (as in modelopt)");
  }
  if (block_size < 1) {
    throw Error("mdist::quant: the block size must be positive, not " + std::to_string(block_size));
  }
  QuantFormat format = *this;
  format.block_kind_ = BlockKind::static_blocks;
  format.block_size_ = block_size;
  return format;
}

double QuantFormat::maxbound() const {
  if (is_e4m3()) return 448.0;
  if (is_nvfp4()) return 6.0;
  return static_cast<double>((std::int64_t{1} << (num_bits_ - 1 + (unsigned_ ? 1 : 0))) - 1);
}

std::string QuantFormat::str() const {
  if (is_nvfp4()) return "nvfp4 (e2m1, dynamic blocks of 16, e4m3 scales)";
  std::string name =
      is_float() ? "e" + std::to_string(exponent_bits_) + "m" + std::to_string(mantissa_bits_)
                 : (unsigned_ ? "uint" : "int") + std::to_string(num_bits_);
  if (narrow_range_) name += " narrow-range";
  if (block_kind_ == BlockKind::static_blocks) {
    return name + " static blocks of " + std::to_string(block_size_);
  }
  return name + (axis_ == Axis::per_row ? " per-row" : " per-tensor");
}

}  // namespace mdist::quant
