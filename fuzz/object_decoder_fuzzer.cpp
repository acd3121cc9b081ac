// libFuzzer target for the object decoder (mdist/objects/codec.h, tensor_codec.cpp).
//
// The first byte picks the type to decode (object_decoder_types.h), the rest is the buffer.
// Decoding must either succeed or throw mdist::DecodeError. Anything else -- another
// exception, a sanitizer report, an allocation past -rss_limit_mb -- is a bug and must
// crash, so nothing else is caught here. A decoded value must also encode again and decode
// to the same value (see Encoding in object_decoder_types.h for how strictly that is checked).
#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <typeinfo>
#include <vector>

#include "mdist/error.h"
#include "object_decoder_types.h"

namespace {

[[noreturn]] void fail(const char* what, const char* type) {
  std::fprintf(stderr, "object_decoder_fuzzer: %s (type %s)\n", what, type);
  std::abort();
}

template <class T>
void check(std::span<const std::uint8_t> input) {
  std::optional<T> value;
  try {
    value.emplace(mdist::from_bytes<T>(input));
  } catch (const mdist::DecodeError&) {
    return;  // the expected outcome for almost every input
  }
  const char* const type = typeid(T).name();
  // Everything the decoder accepts is a value the encoder can send; these throw on a bug.
  const std::vector<std::uint8_t> encoded = mdist::to_bytes(*value);
  const T again = mdist::from_bytes<T>(encoded);
  using mdist_fuzz::Encoding;
  constexpr Encoding kEncoding = mdist_fuzz::EncodingOf<T>::value;
  if constexpr (kEncoding == Encoding::kCanonical) {
    if (!std::equal(encoded.begin(), encoded.end(), input.begin(), input.end())) {
      fail("re-encoding a decoded value does not give back the input", type);
    }
  } else if constexpr (kEncoding == Encoding::kStable) {
    if (mdist::to_bytes(again) != encoded) fail("decode(encode(value)) encodes differently", type);
  } else {
    static_assert(std::equality_comparable<T>, "compare hash-ordered values by value");
    if (!(again == *value)) fail("decode(encode(value)) differs from the value", type);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::span<const std::uint8_t> input(data + 1, size - 1);
  mdist_fuzz::visit_decode_type(data[0] % mdist_fuzz::kTypeCount,
                                [&]<class T>() { check<T>(input); });
  return 0;
}
