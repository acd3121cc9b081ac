#pragma once
// A binary codec for C++ values, used by the object collectives (collectives.h).
//
// Unlike Python's pickle it never runs code: decoding only fills the type the caller names,
// and every read is bounds-checked, so a corrupt, truncated or mismatched buffer raises
// DecodeError instead of crashing or allocating without limit.
//
// Supported: bool, integers, floating point, enums, std::string, std::vector, std::deque,
// std::list, std::array, std::set, std::unordered_set, std::map, std::unordered_map,
// std::pair, std::tuple, std::optional, at::Tensor (any dtype, shape, device), and any
// nesting of these.
//
// Extension point for your own types: specialise mdist::Codec, composing the built-in codecs.
//
//   struct Stats { double amax; std::string name; };
//   template <> struct mdist::Codec<Stats> {
//     static void encode(mdist::ByteWriter& out, const Stats& s) {
//       mdist::encode(out, s.amax);
//       mdist::encode(out, s.name);
//     }
//     static Stats decode(mdist::ByteReader& in) {
//       Stats s;
//       s.amax = mdist::decode<double>(in);
//       s.name = mdist::decode<std::string>(in);
//       return s;
//     }
//   };
//
// Wire format (little-endian, as every platform libtorch supports): a 4-byte header "MDO1",
// then the value. Each value starts with a tag byte saying what kind it is, so a rank that
// sent another type than the receiver expects is reported, not misread.
#include <algorithm>
#include <array>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "mdist/error.h"

namespace at {
class Tensor;
}

namespace mdist {

enum class Tag : std::uint8_t {
  kBool = 1,
  kSigned = 2,
  kUnsigned = 3,
  kFloat = 4,
  kString = 5,
  kSequence = 6,
  kPackedArray = 7,
  kMap = 8,
  kPair = 9,
  kTuple = 10,
  kOptional = 11,
  kTensor = 12,
  kSet = 13,
};

const char* tag_name(std::uint8_t tag);

class ByteWriter {
 public:
  void write(const void* data, std::size_t size) {
    if (size == 0) return;
    // resize + memcpy rather than insert(): GCC 12 reports a false -Wstringop-overflow there.
    const std::size_t old_size = buffer_.size();
    buffer_.resize(old_size + size);
    std::memcpy(buffer_.data() + old_size, data, size);
  }
  template <class T>
  requires std::is_trivially_copyable_v<T>
  void write_raw(const T& value) { write(&value, sizeof(T)); }
  void write_tag(Tag tag) { buffer_.push_back(static_cast<std::uint8_t>(tag)); }
  void write_length(std::size_t length) { write_raw(static_cast<std::uint64_t>(length)); }

  const std::vector<std::uint8_t>& bytes() const { return buffer_; }
  std::vector<std::uint8_t> take() { return std::move(buffer_); }

 private:
  std::vector<std::uint8_t> buffer_;
};

class ByteReader {
 public:
  explicit ByteReader(std::span<const std::uint8_t> data) : data_(data) {}

  void read(void* out, std::size_t size) {
    require(size, "data");
    // memcpy needs valid pointers even for 0 bytes, and an empty vector's data() is null.
    if (size == 0) return;
    std::memcpy(out, data_.data() + offset_, size);
    offset_ += size;
  }
  // A view of the next `size` bytes, consumed.
  std::span<const std::uint8_t> read_span(std::size_t size, const char* what) {
    require(size, what);
    const auto view = data_.subspan(offset_, size);
    offset_ += size;
    return view;
  }
  template <class T>
  requires std::is_trivially_copyable_v<T> T read_raw() {
    T value;
    read(&value, sizeof(T));
    return value;
  }
  // Reads the tag byte and checks it is `expected`; `type` names what the caller decodes.
  void expect_tag(Tag expected, const char* type) {
    const std::size_t at = offset_;
    const auto tag = read_raw<std::uint8_t>();
    if (tag != static_cast<std::uint8_t>(expected)) {
      throw DecodeError("mdist: object buffer holds " + std::string(tag_name(tag)) + " at offset " +
                        std::to_string(at) + " where " + type +
                        " was expected (did every rank send the same type?)");
    }
  }
  // A container length; each element needs at least `min_element_bytes`, which bounds the
  // length by what is left and so caps allocations on corrupt input.
  std::size_t read_length(std::size_t min_element_bytes, const char* what) {
    const std::size_t at = offset_;
    const auto length = read_raw<std::uint64_t>();
    if (min_element_bytes > 0 && length > remaining() / min_element_bytes) {
      throw DecodeError("mdist: object buffer is corrupt: " + std::string(what) + " length " +
                        std::to_string(length) + " at offset " + std::to_string(at) +
                        " exceeds the " + std::to_string(remaining()) + " bytes left");
    }
    return static_cast<std::size_t>(length);
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw DecodeError("mdist: object buffer is corrupt at offset " + std::to_string(offset_) +
                      ": " + what);
  }

  std::size_t offset() const { return offset_; }
  std::size_t remaining() const { return data_.size() - offset_; }

 private:
  void require(std::size_t size, const char* what) const {
    if (size > remaining()) {
      throw DecodeError("mdist: object buffer is truncated: " + std::string(what) + " needs " +
                        std::to_string(size) + " bytes at offset " + std::to_string(offset_) +
                        ", only " + std::to_string(remaining()) + " left");
    }
  }

  std::span<const std::uint8_t> data_;
  std::size_t offset_ = 0;
};

// Specialise for your own types (see the top of this file).
template <class T, class Enable = void>
struct Codec;

template <class T>
concept Encodable = requires(ByteWriter& out, ByteReader& in, const T& value) {
  Codec<T>::encode(out, value);
  { Codec<T>::decode(in) } -> std::same_as<T>;
};

template <class T>
void encode(ByteWriter& out, const T& value) {
  static_assert(
      Encodable<T>,
      "mdist: no Codec for this type; specialise mdist::Codec<T> (see mdist/objects/codec.h)");
  Codec<T>::encode(out, value);
}

template <class T>
T decode(ByteReader& in) {
  static_assert(
      Encodable<T>,
      "mdist: no Codec for this type; specialise mdist::Codec<T> (see mdist/objects/codec.h)");
  return Codec<T>::decode(in);
}

inline constexpr std::array<std::uint8_t, 4> kObjectMagic = {'M', 'D', 'O', '1'};

// A whole buffer: header, value.
template <class T>
std::vector<std::uint8_t> to_bytes(const T& value) {
  ByteWriter out;
  out.write(kObjectMagic.data(), kObjectMagic.size());
  encode(out, value);
  return out.take();
}

// Decodes a buffer made by to_bytes<T>; every byte must be used.
template <class T>
T from_bytes(std::span<const std::uint8_t> bytes) {
  ByteReader in(bytes);
  std::array<std::uint8_t, 4> magic{};
  if (bytes.size() < magic.size()) {
    throw DecodeError("mdist: object buffer is truncated: " + std::to_string(bytes.size()) +
                      " bytes, shorter than its 4-byte header");
  }
  in.read(magic.data(), magic.size());
  if (magic != kObjectMagic) {
    throw DecodeError("mdist: object buffer has no 'MDO1' header: not made by mdist's codec");
  }
  T value = decode<T>(in);
  if (in.remaining() != 0) {
    throw DecodeError("mdist: object buffer has " + std::to_string(in.remaining()) +
                      " trailing bytes after the value at offset " + std::to_string(in.offset()));
  }
  return value;
}

// ---- scalars -------------------------------------------------------------------------------

namespace detail {
template <class T>
constexpr Tag scalar_tag() {
  if constexpr (std::is_same_v<T, bool>) {
    return Tag::kBool;
  } else if constexpr (std::is_floating_point_v<T>) {
    return Tag::kFloat;
  } else if constexpr (std::is_signed_v<T>) {
    return Tag::kSigned;
  } else {
    return Tag::kUnsigned;
  }
}
template <class T>
constexpr const char* scalar_name() {
  if constexpr (std::is_same_v<T, bool>) {
    return "a bool";
  } else if constexpr (std::is_floating_point_v<T>) {
    return "a floating-point number";
  } else if constexpr (std::is_signed_v<T>) {
    return "a signed integer";
  } else {
    return "an unsigned integer";
  }
}
}  // namespace detail

template <class T>
requires std::is_arithmetic_v<T>
struct Codec<T> {
  static void encode(ByteWriter& out, const T& value) {
    out.write_tag(detail::scalar_tag<T>());
    out.write_raw(static_cast<std::uint8_t>(sizeof(T)));
    if constexpr (std::is_same_v<T, bool>) {
      out.write_raw(static_cast<std::uint8_t>(value ? 1 : 0));
    } else {
      out.write_raw(value);
    }
  }
  static T decode(ByteReader& in) {
    in.expect_tag(detail::scalar_tag<T>(), detail::scalar_name<T>());
    const auto width = in.read_raw<std::uint8_t>();
    if (width != sizeof(T)) {
      in.fail(std::string(detail::scalar_name<T>()) + " of " + std::to_string(width) +
              " bytes where " + std::to_string(sizeof(T)) + " were expected");
    }
    if constexpr (std::is_same_v<T, bool>) {
      const auto byte = in.read_raw<std::uint8_t>();
      if (byte > 1) in.fail("bool byte " + std::to_string(byte) + " is neither 0 nor 1");
      return byte == 1;
    } else {
      return in.read_raw<T>();
    }
  }
};

// Only enums with a fixed underlying type (every enum class, or `enum E : int`): decoding an
// out-of-range value into an enum without one would be undefined behaviour.
template <class T>
requires std::is_enum_v<T> && requires(std::underlying_type_t<T> u) { T{u}; }
struct Codec<T> {
  using Underlying = std::underlying_type_t<T>;
  static void encode(ByteWriter& out, const T& value) {
    Codec<Underlying>::encode(out, static_cast<Underlying>(value));
  }
  static T decode(ByteReader& in) { return static_cast<T>(Codec<Underlying>::decode(in)); }
};

template <>
struct Codec<std::string> {
  static void encode(ByteWriter& out, const std::string& value) {
    out.write_tag(Tag::kString);
    out.write_length(value.size());
    out.write(value.data(), value.size());
  }
  static std::string decode(ByteReader& in) {
    in.expect_tag(Tag::kString, "a string");
    const auto length = in.read_length(1, "string");
    const auto bytes = in.read_span(length, "string");
    return std::string(bytes.begin(), bytes.end());
  }
};

// ---- sequences -----------------------------------------------------------------------------

namespace detail {

template <class C>
void encode_elements(ByteWriter& out, const C& container, Tag tag) {
  out.write_tag(tag);
  out.write_length(container.size());
  for (const auto& element : container) mdist::encode(out, element);
}

// Arithmetic vectors go as one block: tag, element kind and width, count, raw bytes.
template <class T>
void encode_packed(ByteWriter& out, const T* data, std::size_t count) {
  out.write_tag(Tag::kPackedArray);
  out.write_raw(static_cast<std::uint8_t>(scalar_tag<T>()));
  out.write_raw(static_cast<std::uint8_t>(sizeof(T)));
  out.write_length(count);
  out.write(data, count * sizeof(T));
}

template <class T>
std::size_t decode_packed_header(ByteReader& in) {
  in.expect_tag(Tag::kPackedArray, "an array of numbers");
  const auto kind = in.read_raw<std::uint8_t>();
  const auto width = in.read_raw<std::uint8_t>();
  if (kind != static_cast<std::uint8_t>(scalar_tag<T>()) || width != sizeof(T)) {
    in.fail(std::string("array of ") + tag_name(kind) + " of width " + std::to_string(width) +
            " where " + scalar_name<T>() + " of width " + std::to_string(sizeof(T)) +
            " was expected");
  }
  return in.read_length(sizeof(T), "array");
}

}  // namespace detail

template <class T, class A>
struct Codec<std::vector<T, A>> {
  static constexpr bool kPacked = std::is_arithmetic_v<T> && !std::is_same_v<T, bool>;
  static void encode(ByteWriter& out, const std::vector<T, A>& value) {
    if constexpr (kPacked) {
      detail::encode_packed(out, value.data(), value.size());
    } else {
      detail::encode_elements(out, value, Tag::kSequence);
    }
  }
  static std::vector<T, A> decode(ByteReader& in) {
    std::vector<T, A> result;
    if constexpr (kPacked) {
      const auto count = detail::decode_packed_header<T>(in);
      result.resize(count);
      in.read(result.data(), count * sizeof(T));
    } else {
      in.expect_tag(Tag::kSequence, "a sequence");
      const auto count = in.read_length(1, "sequence");
      // count is bounded by the bytes left, but sizeof(T) can far exceed an element's
      // encoding: reserve no more memory than the input holds and let push_back grow.
      result.reserve(std::min(count, in.remaining() / sizeof(T)));
      for (std::size_t i = 0; i < count; ++i) result.push_back(mdist::decode<T>(in));
    }
    return result;
  }
};

namespace detail {
template <class C>
struct SequenceCodec {
  using T = typename C::value_type;
  static void encode(ByteWriter& out, const C& value) {
    encode_elements(out, value, Tag::kSequence);
  }
  static C decode(ByteReader& in) {
    in.expect_tag(Tag::kSequence, "a sequence");
    const auto count = in.read_length(1, "sequence");
    C result;
    for (std::size_t i = 0; i < count; ++i) result.push_back(mdist::decode<T>(in));
    return result;
  }
};
template <class C>
struct SetCodec {
  using T = typename C::value_type;
  static void encode(ByteWriter& out, const C& value) { encode_elements(out, value, Tag::kSet); }
  static C decode(ByteReader& in) {
    in.expect_tag(Tag::kSet, "a set");
    const auto count = in.read_length(1, "set");
    C result;
    for (std::size_t i = 0; i < count; ++i) {
      if (!result.insert(mdist::decode<T>(in)).second) in.fail("set holds a duplicate element");
    }
    return result;
  }
};
template <class C>
struct MapCodec {
  using K = typename C::key_type;
  using V = typename C::mapped_type;
  static void encode(ByteWriter& out, const C& value) {
    out.write_tag(Tag::kMap);
    out.write_length(value.size());
    for (const auto& [key, mapped] : value) {
      mdist::encode(out, key);
      mdist::encode(out, mapped);
    }
  }
  static C decode(ByteReader& in) {
    in.expect_tag(Tag::kMap, "a map");
    const auto count = in.read_length(2, "map");
    C result;
    for (std::size_t i = 0; i < count; ++i) {
      K key = mdist::decode<K>(in);
      V mapped = mdist::decode<V>(in);
      if (!result.emplace(std::move(key), std::move(mapped)).second) {
        in.fail("map holds a duplicate key");
      }
    }
    return result;
  }
};
}  // namespace detail

template <class T, class A>
struct Codec<std::deque<T, A>> : detail::SequenceCodec<std::deque<T, A>> {};
template <class T, class A>
struct Codec<std::list<T, A>> : detail::SequenceCodec<std::list<T, A>> {};
template <class T, class C, class A>
struct Codec<std::set<T, C, A>> : detail::SetCodec<std::set<T, C, A>> {};
template <class T, class H, class E, class A>
struct Codec<std::unordered_set<T, H, E, A>> : detail::SetCodec<std::unordered_set<T, H, E, A>> {};
template <class K, class V, class C, class A>
struct Codec<std::map<K, V, C, A>> : detail::MapCodec<std::map<K, V, C, A>> {};
template <class K, class V, class H, class E, class A>
struct Codec<std::unordered_map<K, V, H, E, A>>
    : detail::MapCodec<std::unordered_map<K, V, H, E, A>> {};

template <class T, std::size_t N>
struct Codec<std::array<T, N>> {
  static void encode(ByteWriter& out, const std::array<T, N>& value) {
    detail::encode_elements(out, value, Tag::kSequence);
  }
  static std::array<T, N> decode(ByteReader& in) {
    in.expect_tag(Tag::kSequence, "a fixed-size array");
    const auto count = in.read_length(1, "array");
    if (count != N) {
      in.fail("array of " + std::to_string(count) + " elements where " + std::to_string(N) +
              " were expected");
    }
    std::array<T, N> result{};
    for (auto& element : result) element = mdist::decode<T>(in);
    return result;
  }
};

// ---- products and optionals ----------------------------------------------------------------

template <class A, class B>
struct Codec<std::pair<A, B>> {
  static void encode(ByteWriter& out, const std::pair<A, B>& value) {
    out.write_tag(Tag::kPair);
    mdist::encode(out, value.first);
    mdist::encode(out, value.second);
  }
  static std::pair<A, B> decode(ByteReader& in) {
    in.expect_tag(Tag::kPair, "a pair");
    A first = mdist::decode<A>(in);
    B second = mdist::decode<B>(in);
    return {std::move(first), std::move(second)};
  }
};

template <class... Ts>
struct Codec<std::tuple<Ts...>> {
  static void encode(ByteWriter& out, const std::tuple<Ts...>& value) {
    out.write_tag(Tag::kTuple);
    out.write_raw(static_cast<std::uint32_t>(sizeof...(Ts)));
    std::apply([&](const auto&... element) { (mdist::encode(out, element), ...); }, value);
  }
  static std::tuple<Ts...> decode(ByteReader& in) {
    in.expect_tag(Tag::kTuple, "a tuple");
    const auto arity = in.read_raw<std::uint32_t>();
    if (arity != sizeof...(Ts)) {
      in.fail("tuple of " + std::to_string(arity) + " elements where " +
              std::to_string(sizeof...(Ts)) + " were expected");
    }
    // Braced initialisation evaluates left to right, matching the encoding order.
    return std::tuple<Ts...>{mdist::decode<Ts>(in)...};
  }
};

template <class T>
struct Codec<std::optional<T>> {
  static void encode(ByteWriter& out, const std::optional<T>& value) {
    out.write_tag(Tag::kOptional);
    out.write_raw(static_cast<std::uint8_t>(value ? 1 : 0));
    if (value) mdist::encode(out, *value);
  }
  static std::optional<T> decode(ByteReader& in) {
    in.expect_tag(Tag::kOptional, "an optional");
    const auto present = in.read_raw<std::uint8_t>();
    if (present > 1) in.fail("optional flag " + std::to_string(present) + " is neither 0 nor 1");
    if (present == 0) return std::nullopt;
    return mdist::decode<T>(in);
  }
};

// ---- tensors (src/objects/tensor_codec.cpp) -------------------------------------------------

// Any dtype, shape and device; non-contiguous tensors are sent contiguous. Decoded tensors
// land on the same device type (CUDA: this process's current device) and do not require grad.
template <>
struct Codec<at::Tensor> {
  static void encode(ByteWriter& out, const at::Tensor& value);
  static at::Tensor decode(ByteReader& in);
};

}  // namespace mdist
