// Codec<at::Tensor>: dtype, device type, shape, then the raw bytes of a contiguous copy.
#include <ATen/ATen.h>

#include <algorithm>

#include "mdist/objects/codec.h"
#ifdef MDIST_HAS_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace mdist {
namespace {

constexpr std::uint32_t kMaxDims = 64;

bool is_supported_dtype(std::int8_t code) {
  switch (static_cast<c10::ScalarType>(code)) {
    case c10::ScalarType::Bool:
    case c10::ScalarType::Byte:
    case c10::ScalarType::Char:
    case c10::ScalarType::Short:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::UInt16:
    case c10::ScalarType::UInt32:
    case c10::ScalarType::UInt64:
    case c10::ScalarType::Half:
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::ComplexHalf:
    case c10::ScalarType::ComplexFloat:
    case c10::ScalarType::ComplexDouble:
    case c10::ScalarType::Float8_e4m3fn:
    case c10::ScalarType::Float8_e5m2:
      return true;
    default:
      return false;
  }
}

enum class WireDevice : std::uint8_t { kCPU = 0, kCUDA = 1 };

}  // namespace

void Codec<at::Tensor>::encode(ByteWriter& out, const at::Tensor& value) {
  if (!value.defined()) throw Error("mdist: cannot send an undefined tensor");
  if (value.layout() != c10::kStrided || value.is_quantized()) {
    throw Error("mdist: cannot send a sparse or quantized tensor; convert it to a dense one");
  }
  if (!is_supported_dtype(static_cast<std::int8_t>(value.scalar_type()))) {
    throw Error(std::string("mdist: cannot send a tensor of dtype ") +
                c10::toString(value.scalar_type()));
  }
  WireDevice device = WireDevice::kCPU;
  if (value.is_cuda()) {
    device = WireDevice::kCUDA;
  } else if (!value.is_cpu()) {
    throw Error("mdist: cannot send a tensor on device " + value.device().str() +
                "; only CPU and CUDA tensors are supported");
  }
  // resolve_conj/resolve_neg: a conjugate or negative view shares its storage with the
  // original, and data_ptr() would send the original's values.
  const at::Tensor host = value.detach().to(c10::kCPU).resolve_conj().resolve_neg().contiguous();
  out.write_tag(Tag::kTensor);
  out.write_raw(static_cast<std::int8_t>(value.scalar_type()));
  out.write_raw(static_cast<std::uint8_t>(device));
  out.write_raw(static_cast<std::uint32_t>(host.dim()));
  for (const auto size : host.sizes()) out.write_raw(static_cast<std::int64_t>(size));
  out.write_length(host.nbytes());
  out.write(host.data_ptr(), host.nbytes());
}

at::Tensor Codec<at::Tensor>::decode(ByteReader& in) {
  in.expect_tag(Tag::kTensor, "a tensor");
  const auto dtype_code = in.read_raw<std::int8_t>();
  if (!is_supported_dtype(dtype_code)) {
    in.fail("unknown tensor dtype code " + std::to_string(dtype_code));
  }
  const auto dtype = static_cast<c10::ScalarType>(dtype_code);
  const auto device = in.read_raw<std::uint8_t>();
  if (device > static_cast<std::uint8_t>(WireDevice::kCUDA)) {
    in.fail("unknown tensor device code " + std::to_string(device));
  }
  const auto dims = in.read_raw<std::uint32_t>();
  if (dims > kMaxDims) in.fail("tensor has " + std::to_string(dims) + " dimensions");
  std::vector<std::int64_t> sizes(dims);
  // Checked before multiplying so a corrupt shape cannot overflow: the bound covers the byte
  // count (numel times the element size) and every contiguous stride at::empty computes, the
  // product of the sizes with 0 counted as 1, so a zero-size dimension cannot hide huge ones.
  const std::uint64_t element_size = c10::elementSize(dtype);
  const std::uint64_t max_elements = (std::uint64_t{1} << 62) / element_size;
  std::uint64_t numel = 1;
  std::uint64_t extent = 1;
  for (auto& size : sizes) {
    size = in.read_raw<std::int64_t>();
    if (size < 0) in.fail("negative tensor size " + std::to_string(size));
    const std::uint64_t extent_factor =
        std::max<std::uint64_t>(static_cast<std::uint64_t>(size), 1);
    if (extent > max_elements / extent_factor) in.fail("tensor shape is too large");
    extent *= extent_factor;
    numel *= static_cast<std::uint64_t>(size);
  }
  const std::uint64_t expected = numel * element_size;
  const auto nbytes = in.read_length(0, "tensor data");
  if (nbytes != expected) {
    in.fail("tensor data of " + std::to_string(nbytes) + " bytes where its shape needs " +
            std::to_string(expected));
  }
  const auto data = in.read_span(nbytes, "tensor data");
  // Like a scalar bool: any other byte would be a bool that is undefined behaviour to read.
  if (dtype == c10::ScalarType::Bool &&
      std::any_of(data.begin(), data.end(), [](std::uint8_t byte) { return byte > 1; })) {
    in.fail("bool tensor holds a byte that is neither 0 nor 1");
  }
  at::Tensor host = at::empty(sizes, at::TensorOptions().dtype(dtype));
  if (nbytes > 0) std::memcpy(host.data_ptr(), data.data(), nbytes);
  if (device == static_cast<std::uint8_t>(WireDevice::kCUDA)) {
#ifdef MDIST_HAS_CUDA
    return host.to(
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(c10::cuda::current_device())));
#else
    throw DecodeError("mdist: a CUDA tensor arrived, but this mdist build has no CUDA support");
#endif
  }
  return host;
}

}  // namespace mdist
