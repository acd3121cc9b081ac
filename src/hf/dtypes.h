#pragma once
// Dtypes of a model's tensors as the Hugging Face side names and weighs them: config.json's
// spelling ("bfloat16", torch's attribute name) and the dtype that holds most elements (a few
// fp32 norms do not outvote bf16 matrices). Shared by fsdp2_wrap (which parameters stay
// whole) and save_pretrained (which dtype config.json names).
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <string>

namespace mdist::hf::detail {

inline std::string dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      return "float32";
    case c10::kBFloat16:
      return "bfloat16";
    case c10::kHalf:
      return "float16";
    case c10::kDouble:
      return "float64";
    default:
      return c10::toString(dtype);
  }
}

// The dtype with the most elements among `tensors` (any range of at::Tensor, or of pairs
// whose .second is one), float32 for none.
template <class Tensors, class Get>
c10::ScalarType dominant_dtype(const Tensors& tensors, Get tensor_of) {
  std::map<c10::ScalarType, std::int64_t> elements;
  for (const auto& item : tensors) {
    const auto& tensor = tensor_of(item);
    elements[tensor.scalar_type()] += tensor.numel();
  }
  c10::ScalarType dominant = c10::kFloat;
  std::int64_t most = -1;
  for (const auto& [dtype, count] : elements) {
    if (count > most) {
      dominant = dtype;
      most = count;
    }
  }
  return dominant;
}

}  // namespace mdist::hf::detail
