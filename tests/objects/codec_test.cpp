// Unit tests of the object codec: every supported type round-trips, and every corrupt,
// truncated or mismatched buffer is reported as a DecodeError with a message that names the
// problem -- never a crash, another exception type or an unbounded allocation.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "allocation_tracker.h"
#include "mdist/error.h"
#include "mdist/objects/codec.h"

// ---- the user type of codec.h's top comment, specialised exactly as documented -------------

struct Stats {
  double amax;
  std::string name;
  bool operator==(const Stats&) const = default;
};
template <>
struct mdist::Codec<Stats> {
  static void encode(mdist::ByteWriter& out, const Stats& s) {
    mdist::encode(out, s.amax);
    mdist::encode(out, s.name);
  }
  static Stats decode(mdist::ByteReader& in) {
    Stats s;
    s.amax = mdist::decode<double>(in);
    s.name = mdist::decode<std::string>(in);
    return s;
  }
};

namespace {

using mdist::testing::ScopedAllocationTracker;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using Bytes = std::vector<std::uint8_t>;

// Offsets into a buffer made by to_bytes: the 4-byte header, then the value's tag byte.
constexpr std::size_t kHeader = 4;
constexpr std::size_t kTagAt = kHeader;

template <class T>
T round_trip(const T& value) {
  return mdist::from_bytes<T>(mdist::to_bytes(value));
}

// The message of the DecodeError that decoding `bytes` as T throws; a test failure if it
// throws nothing or anything else.
template <class T>
std::string decode_error(std::span<const std::uint8_t> bytes) {
  try {
    static_cast<void>(mdist::from_bytes<T>(bytes));
  } catch (const mdist::DecodeError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected mdist::DecodeError, got another exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected mdist::DecodeError, decoding succeeded";
  return {};
}

// The message of the mdist::Error that encoding `value` throws.
template <class T>
std::string encode_error(const T& value) {
  try {
    static_cast<void>(mdist::to_bytes(value));
  } catch (const mdist::DecodeError& e) {
    ADD_FAILURE() << "encoding threw a DecodeError: " << e.what();
    return {};
  } catch (const mdist::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected mdist::Error, got another exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected mdist::Error, encoding succeeded";
  return {};
}

// Overwrites the little-endian bytes of `value` at `offset`.
template <class T>
void poke(Bytes& bytes, std::size_t offset, const T& value) {
  ASSERT_LE(offset + sizeof(T), bytes.size());
  std::memcpy(bytes.data() + offset, &value, sizeof(T));
}

// A buffer with the header followed by whatever `fill` writes: for hand-made encodings.
template <class F>
Bytes make_buffer(F&& fill) {
  mdist::ByteWriter out;
  out.write(mdist::kObjectMagic.data(), mdist::kObjectMagic.size());
  fill(out);
  return out.take();
}

std::uint8_t tag_byte(mdist::Tag tag) { return static_cast<std::uint8_t>(tag); }

// ---- wire format ---------------------------------------------------------------------------

// Ranks may run different builds; pin the bytes of a few values so a format change is a
// deliberate one.
TEST(CodecWireFormat, GoldenEncodings) {
  EXPECT_EQ(mdist::to_bytes(std::int32_t{5}), (Bytes{'M', 'D', 'O', '1', 2, 4, 5, 0, 0, 0}));
  EXPECT_EQ(mdist::to_bytes(true), (Bytes{'M', 'D', 'O', '1', 1, 1, 1}));
  EXPECT_EQ(mdist::to_bytes(std::uint16_t{0x0102}), (Bytes{'M', 'D', 'O', '1', 3, 2, 2, 1}));
  EXPECT_EQ(mdist::to_bytes(std::string("hi")),
            (Bytes{'M', 'D', 'O', '1', 5, 2, 0, 0, 0, 0, 0, 0, 0, 'h', 'i'}));
  EXPECT_EQ(mdist::to_bytes(std::optional<bool>{}), (Bytes{'M', 'D', 'O', '1', 11, 0}));
  EXPECT_EQ(mdist::to_bytes(std::vector<std::uint8_t>{7}),
            (Bytes{'M', 'D', 'O', '1', 7, 3, 1, 1, 0, 0, 0, 0, 0, 0, 0, 7}));
  EXPECT_EQ(mdist::to_bytes(std::tuple<>{}), (Bytes{'M', 'D', 'O', '1', 10, 0, 0, 0, 0}));
}

TEST(CodecWireFormat, ArithmeticVectorsArePackedOthersAreSequences) {
  EXPECT_EQ(mdist::to_bytes(std::vector<int>{1, 2})[kTagAt], tag_byte(mdist::Tag::kPackedArray));
  EXPECT_EQ(mdist::to_bytes(std::vector<double>{})[kTagAt], tag_byte(mdist::Tag::kPackedArray));
  // Packed: tag, kind, width, 8-byte count, then the raw elements.
  EXPECT_EQ(mdist::to_bytes(std::vector<double>{1.0, 2.0}).size(), kHeader + 1 + 1 + 1 + 8 + 16);
  EXPECT_EQ(mdist::to_bytes(std::vector<bool>{true})[kTagAt], tag_byte(mdist::Tag::kSequence));
  EXPECT_EQ(mdist::to_bytes(std::vector<std::string>{"a"})[kTagAt],
            tag_byte(mdist::Tag::kSequence));
}

TEST(CodecWireFormat, TagNames) {
  EXPECT_STREQ(mdist::tag_name(tag_byte(mdist::Tag::kTensor)), "a tensor");
  EXPECT_STREQ(mdist::tag_name(tag_byte(mdist::Tag::kSet)), "a set");
  EXPECT_STREQ(mdist::tag_name(0), "an unknown tag");
  EXPECT_STREQ(mdist::tag_name(200), "an unknown tag");
}

// ---- scalars -------------------------------------------------------------------------------

template <class T>
class CodecIntegerTest : public ::testing::Test {};
using IntegerTypes =
    ::testing::Types<std::int8_t, std::uint8_t, std::int16_t, std::uint16_t, std::int32_t,
                     std::uint32_t, std::int64_t, std::uint64_t, char, signed char, unsigned char,
                     char8_t, char16_t, char32_t, wchar_t, long long, unsigned long long>;
TYPED_TEST_SUITE(CodecIntegerTest, IntegerTypes);

TYPED_TEST(CodecIntegerTest, RoundTripsExtremes) {
  using T = TypeParam;
  for (const T value : {std::numeric_limits<T>::min(), std::numeric_limits<T>::max(), T{0},
                        static_cast<T>(1), static_cast<T>(std::numeric_limits<T>::max() / 3)}) {
    EXPECT_EQ(round_trip(value), value);
  }
}

TYPED_TEST(CodecIntegerTest, EncodesTagWidthValue) {
  using T = TypeParam;
  const Bytes bytes = mdist::to_bytes(std::numeric_limits<T>::max());
  ASSERT_EQ(bytes.size(), kHeader + 2 + sizeof(T));
  EXPECT_EQ(bytes[kTagAt],
            tag_byte(std::is_signed_v<T> ? mdist::Tag::kSigned : mdist::Tag::kUnsigned));
  EXPECT_EQ(bytes[kTagAt + 1], sizeof(T));
}

TEST(CodecScalar, Bool) {
  EXPECT_TRUE(round_trip(true));
  EXPECT_FALSE(round_trip(false));
}

TEST(CodecScalar, FloatsRoundTripBitwise) {
  for (const float value :
       {0.0f, -0.0f, 1.5f, -3.25e-30f, std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min(),
        std::numeric_limits<float>::max(), std::numeric_limits<float>::quiet_NaN()}) {
    EXPECT_EQ(std::bit_cast<std::uint32_t>(round_trip(value)), std::bit_cast<std::uint32_t>(value));
  }
  for (const double value :
       {0.0, -0.0, 1.0 / 3.0, 1e308, std::numeric_limits<double>::lowest(),
        std::numeric_limits<double>::denorm_min(), std::numeric_limits<double>::infinity(),
        -std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::signaling_NaN()}) {
    EXPECT_EQ(std::bit_cast<std::uint64_t>(round_trip(value)), std::bit_cast<std::uint64_t>(value));
  }
  EXPECT_EQ(round_trip(2.5L), 2.5L);
}

enum class Small : std::int8_t { kLow = -128, kMid = 7, kHigh = 127 };
enum class Wide : std::uint64_t { kA = 1, kB = std::numeric_limits<std::uint64_t>::max() };
enum class Plain { kX, kY, kZ };
enum Unscoped : short { kUnscopedA = -2, kUnscopedB = 300 };

TEST(CodecScalar, Enums) {
  EXPECT_EQ(round_trip(Small::kLow), Small::kLow);
  EXPECT_EQ(round_trip(Small::kMid), Small::kMid);
  EXPECT_EQ(round_trip(Small::kHigh), Small::kHigh);
  EXPECT_EQ(round_trip(Wide::kB), Wide::kB);
  EXPECT_EQ(round_trip(Plain::kZ), Plain::kZ);
  EXPECT_EQ(round_trip(kUnscopedA), kUnscopedA);
  EXPECT_EQ(round_trip(kUnscopedB), kUnscopedB);
  // An enum is its underlying integer on the wire: a rank may send the int8 directly.
  EXPECT_EQ(mdist::to_bytes(Small::kMid), mdist::to_bytes(std::int8_t{7}));
  // Values outside the enumerators are legal for a fixed underlying type and survive.
  EXPECT_EQ(round_trip(static_cast<Small>(-5)), static_cast<Small>(-5));
}

// ---- strings -------------------------------------------------------------------------------

TEST(CodecString, Basic) {
  EXPECT_EQ(round_trip(std::string()), "");
  EXPECT_EQ(round_trip(std::string("hello, world")), "hello, world");
  const std::string with_nuls("\0a\0b\0\0", 6);
  EXPECT_EQ(round_trip(with_nuls), with_nuls);
  EXPECT_EQ(round_trip(with_nuls).size(), 6u);
  const std::string high_bytes = "\xff\xfe\x80 caf\xc3\xa9";
  EXPECT_EQ(round_trip(high_bytes), high_bytes);
}

TEST(CodecString, OneMegabyte) {
  std::mt19937 rng(1);
  std::string big(1 << 20, '\0');
  for (auto& c : big) c = static_cast<char>(rng());
  const Bytes bytes = mdist::to_bytes(big);
  EXPECT_EQ(bytes.size(), kHeader + 1 + 8 + big.size());
  EXPECT_EQ(mdist::from_bytes<std::string>(bytes), big);
}

// ---- containers ----------------------------------------------------------------------------

TEST(CodecContainers, PackedVectors) {
  EXPECT_EQ(round_trip(std::vector<int>{}), std::vector<int>{});
  EXPECT_EQ(round_trip(std::vector<double>{}), std::vector<double>{});
  const std::vector<int> ints = {0, -1, std::numeric_limits<int>::min(),
                                 std::numeric_limits<int>::max(), 42};
  EXPECT_EQ(round_trip(ints), ints);
  std::vector<double> doubles(10'000);
  for (std::size_t i = 0; i < doubles.size(); ++i) doubles[i] = std::sin(static_cast<double>(i));
  EXPECT_EQ(round_trip(doubles), doubles);
  const std::vector<std::uint8_t> bytes = {0, 255, 128};
  EXPECT_EQ(round_trip(bytes), bytes);
  const std::vector<float> floats = {1.5f, -0.0f};
  EXPECT_EQ(round_trip(floats), floats);
  const std::vector<std::int64_t> longs = {std::numeric_limits<std::int64_t>::min()};
  EXPECT_EQ(round_trip(longs), longs);
}

TEST(CodecContainers, VectorOfBool) {
  EXPECT_EQ(round_trip(std::vector<bool>{}), std::vector<bool>{});
  const std::vector<bool> bits = {true, false, false, true, true};
  EXPECT_EQ(round_trip(bits), bits);
}

TEST(CodecContainers, Sequences) {
  const std::vector<std::string> strings = {"", "a", std::string(300, 'z'), std::string(1, '\0')};
  EXPECT_EQ(round_trip(strings), strings);
  EXPECT_EQ(round_trip(std::vector<std::string>{}), std::vector<std::string>{});
  const std::deque<std::int16_t> deque = {1, -2, 3};
  EXPECT_EQ(round_trip(deque), deque);
  EXPECT_EQ(round_trip(std::deque<double>{}), std::deque<double>{});
  const std::list<std::string> list = {"x", "yy", ""};
  EXPECT_EQ(round_trip(list), list);
  const std::vector<std::vector<int>> nested = {{}, {1}, {2, 3}};
  EXPECT_EQ(round_trip(nested), nested);
  const std::vector<Small> enums = {Small::kLow, Small::kHigh};
  EXPECT_EQ(round_trip(enums), enums);
}

TEST(CodecContainers, Arrays) {
  const std::array<int, 3> ints = {1, -2, 3};
  EXPECT_EQ(round_trip(ints), ints);
  const std::array<std::string, 2> strings = {"a", ""};
  EXPECT_EQ(round_trip(strings), strings);
  EXPECT_EQ(round_trip(std::array<double, 0>{}), (std::array<double, 0>{}));
  const std::array<std::array<bool, 2>, 2> grid = {{{true, false}, {false, true}}};
  EXPECT_EQ(round_trip(grid), grid);
}

TEST(CodecContainers, Sets) {
  const std::set<std::string> set = {"b", "a", ""};
  EXPECT_EQ(round_trip(set), set);
  EXPECT_EQ(round_trip(std::set<int>{}), std::set<int>{});
  const std::unordered_set<std::int64_t> unordered = {5, -7, 1LL << 40};
  EXPECT_EQ(round_trip(unordered), unordered);
}

TEST(CodecContainers, Maps) {
  const std::map<std::string, std::vector<double>> map = {
      {"weights", {0.5, -1.25}}, {"empty", {}}, {"", {3.0}}};
  EXPECT_EQ(round_trip(map), map);
  EXPECT_EQ(round_trip(std::map<int, int>{}), (std::map<int, int>{}));
  const std::unordered_map<std::string, std::int32_t> unordered = {{"a", 1}, {"b", -2}};
  EXPECT_EQ(round_trip(unordered), unordered);
  const std::map<std::int8_t, std::set<std::string>> of_sets = {{-1, {"x"}}, {2, {}}};
  EXPECT_EQ(round_trip(of_sets), of_sets);
}

// ---- products and optionals ----------------------------------------------------------------

TEST(CodecProducts, Pair) {
  const std::pair<std::string, double> pair = {"lr", 3e-4};
  EXPECT_EQ(round_trip(pair), pair);
  const std::pair<std::pair<int, bool>, std::vector<int>> nested = {{1, true}, {2, 3}};
  EXPECT_EQ(round_trip(nested), nested);
}

TEST(CodecProducts, Tuple) {
  EXPECT_EQ(round_trip(std::tuple<>{}), std::tuple<>{});
  const std::tuple<int> one = {7};
  EXPECT_EQ(round_trip(one), one);
  const std::tuple<std::int8_t, std::uint64_t, float, std::string, bool> mixed = {
      -1, std::numeric_limits<std::uint64_t>::max(), 2.5f, "s", true};
  EXPECT_EQ(round_trip(mixed), mixed);
  const std::tuple<std::tuple<>, std::tuple<int, std::tuple<std::string>>, double> nested = {
      {}, {1, {"deep"}}, 0.5};
  EXPECT_EQ(round_trip(nested), nested);
}

TEST(CodecProducts, Optional) {
  EXPECT_EQ(round_trip(std::optional<int>{}), std::nullopt);
  EXPECT_EQ(round_trip(std::optional<int>{0}), 0);
  EXPECT_EQ(round_trip(std::optional<std::string>{"x"}), "x");
  const std::optional<std::optional<bool>> inner_empty = std::optional<bool>{};
  EXPECT_EQ(round_trip(inner_empty), inner_empty);
  EXPECT_TRUE(round_trip(inner_empty).has_value());
}

TEST(CodecProducts, NestedComposite) {
  using Entry = std::optional<std::tuple<int, std::vector<float>, std::string>>;
  const std::map<std::string, Entry> value = {
      {"present", Entry{std::tuple{3, std::vector<float>{1.0f, 2.0f}, "three"}}},
      {"absent", std::nullopt},
      {"empty-vector", Entry{std::tuple{-1, std::vector<float>{}, ""}}}};
  EXPECT_EQ(round_trip(value), value);

  const std::vector<std::pair<std::set<std::string>, std::unordered_map<int, std::list<bool>>>>
      deep = {{{"a", "b"}, {{1, {true, false}}, {2, {}}}}, {{}, {}}};
  EXPECT_EQ(round_trip(deep), deep);
}

TEST(CodecUserType, DocumentedSpecialisation) {
  const Stats stats{1.5, "amax/layer0"};
  EXPECT_EQ(round_trip(stats), stats);
  // Encoded as its fields, with no tag of its own.
  EXPECT_EQ(mdist::to_bytes(stats).size(), kHeader + (1 + 1 + 8) + (1 + 8 + 11));
  const std::map<std::string, std::vector<Stats>> per_rank = {{"r0", {stats, Stats{-0.5, ""}}}};
  EXPECT_EQ(round_trip(per_rank), per_rank);
  const std::optional<Stats> none;
  EXPECT_EQ(round_trip(none), none);
}

// ---- tensors -------------------------------------------------------------------------------

std::span<const std::uint8_t> tensor_bytes(const at::Tensor& t) {
  return {static_cast<const std::uint8_t*>(t.data_ptr()), t.nbytes()};
}

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ca = a.contiguous();
  const at::Tensor cb = b.contiguous();
  const auto ba = tensor_bytes(ca);
  const auto bb = tensor_bytes(cb);
  return std::equal(ba.begin(), ba.end(), bb.begin(), bb.end());
}

// A tensor of `dtype` filled with arbitrary bit patterns (every float8 and half pattern
// included), except bool, whose bytes must stay 0 or 1 to be valid bools.
at::Tensor random_tensor(at::ScalarType dtype, at::IntArrayRef sizes, std::uint32_t seed) {
  at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(dtype));
  std::mt19937 rng(seed);
  auto* const data = static_cast<std::uint8_t*>(t.data_ptr());
  for (std::size_t i = 0; i < t.nbytes(); ++i) {
    data[i] = static_cast<std::uint8_t>(dtype == at::kBool ? rng() & 1 : rng());
  }
  return t;
}

class CodecTensorDtypeTest : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(CodecTensorDtypeTest, RoundTripsBitwise) {
  const at::ScalarType dtype = GetParam();
  for (const auto& sizes :
       std::vector<std::vector<std::int64_t>>{{}, {0}, {7}, {2, 3, 4}, {3, 0}}) {
    const at::Tensor t = random_tensor(dtype, sizes, static_cast<std::uint32_t>(sizes.size()));
    const at::Tensor back = round_trip(t);
    EXPECT_EQ(back.scalar_type(), dtype);
    EXPECT_EQ(back.sizes(), t.sizes());
    EXPECT_TRUE(back.is_contiguous());
    EXPECT_TRUE(back.device().is_cpu());
    EXPECT_TRUE(bitwise_equal(back, t)) << c10::toString(dtype) << " " << t.sizes();
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, CodecTensorDtypeTest,
                         ::testing::Values(at::kBool, at::kByte, at::kChar, at::kShort, at::kInt,
                                           at::kLong, at::kUInt16, at::kUInt32, at::kUInt64,
                                           at::kHalf, at::kBFloat16, at::kFloat, at::kDouble,
                                           at::kComplexHalf, at::kComplexFloat, at::kComplexDouble,
                                           at::kFloat8_e4m3fn, at::kFloat8_e5m2),
                         [](const ::testing::TestParamInfo<at::ScalarType>& param) {
                           return std::string(c10::toString(param.param));
                         });

TEST(CodecTensor, ZeroDimensionalScalar) {
  const at::Tensor scalar = at::scalar_tensor(3.5, at::kDouble);
  const at::Tensor back = round_trip(scalar);
  EXPECT_EQ(back.dim(), 0);
  EXPECT_EQ(back.item<double>(), 3.5);
}

TEST(CodecTensor, Empty) {
  const at::Tensor empty = at::empty({4, 0, 2}, at::kFloat);
  const at::Tensor back = round_trip(empty);
  EXPECT_EQ(back.sizes(), empty.sizes());
  EXPECT_EQ(back.numel(), 0);
}

TEST(CodecTensor, NonContiguousDecodesContiguous) {
  const at::Tensor base = at::arange(24, at::kFloat).reshape({4, 6});
  const std::vector<at::Tensor> views = {
      base.t(),                                    // transposed
      base.slice(1, 1, 6, 2),                      // slice with a step
      base.slice(0, 1, 3),                         // contiguous, with a storage offset
      base.select(1, 2),                           // strided 1-d
      at::arange(3, at::kLong).expand({5, 3}),     // zero stride
      base.reshape({2, 2, 6}).permute({2, 0, 1}),  // permuted
  };
  for (const at::Tensor& view : views) {
    const at::Tensor back = round_trip(view);
    EXPECT_TRUE(back.is_contiguous());
    EXPECT_EQ(back.sizes(), view.sizes());
    EXPECT_TRUE(at::equal(back, view)) << view.sizes() << " strides " << view.strides();
  }
  // Only the view's elements travel, not its whole storage.
  EXPECT_EQ(mdist::to_bytes(base.slice(1, 1, 6, 2)).size(),
            mdist::to_bytes(at::empty({4, 3}, at::kFloat)).size());
}

TEST(CodecTensor, RequiresGradIsDropped) {
  const at::Tensor leaf = at::ones({2, 2}, at::kFloat).requires_grad_(true);
  const at::Tensor back = round_trip(leaf);
  EXPECT_FALSE(back.requires_grad());
  EXPECT_TRUE(at::equal(back, leaf.detach()));
  const at::Tensor computed = leaf * 2;  // a non-leaf with a grad_fn
  const at::Tensor back_computed = round_trip(computed);
  EXPECT_FALSE(back_computed.requires_grad());
  EXPECT_FALSE(back_computed.grad_fn());
  EXPECT_TRUE(at::equal(back_computed, computed.detach()));
}

TEST(CodecTensor, DecodedTensorOwnsItsMemory) {
  Bytes bytes = mdist::to_bytes(at::arange(4, at::kInt));
  const at::Tensor back = mdist::from_bytes<at::Tensor>(bytes);
  std::fill(bytes.begin(), bytes.end(), std::uint8_t{0xAB});
  EXPECT_TRUE(at::equal(back, at::arange(4, at::kInt)));
}

TEST(CodecTensor, VectorOfTensors) {
  const std::vector<at::Tensor> tensors = {at::arange(3, at::kLong), at::empty({0}, at::kHalf),
                                           at::scalar_tensor(true, at::kBool),
                                           at::eye(3, at::kDouble).t()};
  const auto back = round_trip(tensors);
  ASSERT_EQ(back.size(), tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(back[i], tensors[i])) << i;
  }
  EXPECT_TRUE(round_trip(std::vector<at::Tensor>{}).empty());
}

TEST(CodecTensor, InsideComposites) {
  const std::map<std::string, std::optional<std::pair<at::Tensor, int>>> value = {
      {"w", std::pair{at::full({2}, 1.5, at::kBFloat16), 1}}, {"none", std::nullopt}};
  const auto back = round_trip(value);
  ASSERT_EQ(back.size(), 2u);
  EXPECT_FALSE(back.at("none").has_value());
  ASSERT_TRUE(back.at("w").has_value());
  EXPECT_TRUE(bitwise_equal(back.at("w")->first, value.at("w")->first));
  EXPECT_EQ(back.at("w")->second, 1);
}

// A conjugate or negative view shares its storage with the original and only flags the
// operation; the receiver must get the view's values, not the storage's.
TEST(CodecTensor, ConjugateAndNegativeViewsSendTheirValues) {
  const at::Tensor z = at::complex(at::arange(3, at::kFloat), at::ones({3}, at::kFloat));
  const at::Tensor conj = z.conj();
  ASSERT_TRUE(conj.is_conj());
  EXPECT_TRUE(at::equal(round_trip(conj), conj.resolve_conj()));
  const at::Tensor neg = at::_neg_view(at::arange(3, at::kFloat));
  ASSERT_TRUE(neg.is_neg());
  EXPECT_TRUE(at::equal(round_trip(neg), neg.resolve_neg()));
}

TEST(CodecTensorEncode, UndefinedTensor) {
  EXPECT_THAT(encode_error(at::Tensor()), HasSubstr("cannot send an undefined tensor"));
}

TEST(CodecTensorEncode, SparseTensor) {
  EXPECT_THAT(encode_error(at::ones({2, 2}).to_sparse()), HasSubstr("sparse or quantized"));
}

TEST(CodecTensorEncode, QuantizedTensor) {
  const at::Tensor q = at::quantize_per_tensor(at::ones({2}), 0.1, 0, at::kQInt8);
  EXPECT_THAT(encode_error(q), HasSubstr("sparse or quantized"));
}

TEST(CodecTensorEncode, UnsupportedDtype) {
  EXPECT_THAT(encode_error(at::empty({2}, at::kFloat8_e4m3fnuz)),
              HasSubstr("cannot send a tensor of dtype Float8_e4m3fnuz"));
}

TEST(CodecTensorEncode, UnsupportedDevice) {
  EXPECT_THAT(encode_error(at::empty({2}, at::TensorOptions().device(at::kMeta))),
              AllOf(HasSubstr("on device meta"), HasSubstr("only CPU and CUDA")));
}

TEST(CodecTensorEncode, ErrorInsideAContainerPropagates) {
  EXPECT_THAT(encode_error(std::vector<at::Tensor>{at::ones({1}), at::Tensor()}),
              HasSubstr("undefined tensor"));
}

// ---- decode errors: framing ----------------------------------------------------------------

TEST(CodecDecodeError, EmptyAndShorterThanHeader) {
  EXPECT_THAT(decode_error<int>({}), HasSubstr("0 bytes, shorter than its 4-byte header"));
  const Bytes three = {'M', 'D', 'O'};
  EXPECT_THAT(decode_error<int>(three), HasSubstr("3 bytes, shorter than its 4-byte header"));
}

TEST(CodecDecodeError, HeaderOnly) {
  const Bytes header(mdist::kObjectMagic.begin(), mdist::kObjectMagic.end());
  EXPECT_THAT(decode_error<int>(header), HasSubstr("truncated"));
  EXPECT_THAT(decode_error<std::tuple<>>(header), HasSubstr("truncated"));
}

TEST(CodecDecodeError, BadMagic) {
  Bytes bytes = mdist::to_bytes(1);
  bytes[3] = '2';
  EXPECT_THAT(decode_error<int>(bytes), HasSubstr("no 'MDO1' header"));
  // Another serialiser's output (a pickle) is refused the same way.
  const Bytes pickle = {0x80, 0x04, 0x95, 0x00, 0x00};
  EXPECT_THAT(decode_error<std::string>(pickle), HasSubstr("no 'MDO1' header"));
}

TEST(CodecDecodeError, TrailingBytes) {
  Bytes bytes = mdist::to_bytes(std::int32_t{1});
  const std::size_t value_end = bytes.size();
  bytes.push_back(0);
  bytes.push_back(0);
  EXPECT_THAT(decode_error<std::int32_t>(bytes),
              HasSubstr("2 trailing bytes after the value at offset " + std::to_string(value_end)));
  // Two values concatenated are not one value.
  Bytes twice = mdist::to_bytes(std::string("a"));
  const Bytes second = mdist::to_bytes(std::string("b"));
  twice.insert(twice.end(), second.begin() + kHeader, second.end());
  EXPECT_THAT(decode_error<std::string>(twice), HasSubstr("trailing bytes"));
}

// A composite of every kind of value, for the cut-point and bit-flip loops.
using Composite =
    std::tuple<std::map<std::string, std::vector<double>>, std::optional<Stats>,
               std::set<std::string>, std::vector<bool>, std::array<std::int16_t, 2>,
               std::pair<std::uint64_t, std::list<std::string>>, std::vector<at::Tensor>,
               std::unordered_map<std::int32_t, std::deque<float>>, Small, bool>;

Composite make_composite() {
  return Composite{{{"a", {1.0, 2.0}}, {"bb", {}}},
                   Stats{0.25, "st"},
                   {"x", "yz"},
                   {true, false, true},
                   {-1, 2},
                   {99, {"p", ""}},
                   {at::arange(6, at::kFloat).reshape({2, 3}), at::empty({0, 2}, at::kLong),
                    at::scalar_tensor(1, at::kByte)},
                   {{7, {0.5f}}},
                   Small::kMid,
                   true};
}

TEST(CodecDecodeError, TruncatedAtEveryCutPoint) {
  const Bytes bytes = mdist::to_bytes(make_composite());
  ASSERT_GT(bytes.size(), 200u);
  for (std::size_t cut = 0; cut < bytes.size(); ++cut) {
    const std::string message =
        decode_error<Composite>(std::span<const std::uint8_t>(bytes.data(), cut));
    // A cut inside a field is "truncated"; a cut after a length field makes that length
    // larger than what is left.
    EXPECT_THAT(message, AllOf(StartsWith("mdist: object buffer"),
                               AnyOf(HasSubstr("truncated"), HasSubstr("exceeds the"))))
        << "cut at " << cut << " of " << bytes.size();
  }
  EXPECT_NO_THROW(static_cast<void>(mdist::from_bytes<Composite>(bytes)));
}

TEST(CodecDecodeError, TruncatedMessagesNameTheField) {
  const Bytes bytes = mdist::to_bytes(std::string("abcdef"));
  EXPECT_THAT(decode_error<std::string>(std::span(bytes.data(), bytes.size() - 1)),
              HasSubstr("string length 6 at offset 5 exceeds the 5 bytes left"));
  const Bytes ints = mdist::to_bytes(std::int64_t{1});
  EXPECT_THAT(decode_error<std::int64_t>(std::span(ints.data(), ints.size() - 3)),
              HasSubstr("truncated: data needs 8 bytes at offset 6, only 5 left"));
}

// ---- decode errors: type mismatches --------------------------------------------------------

TEST(CodecDecodeError, TypeMismatchNamesBothTypes) {
  const Bytes bytes = mdist::to_bytes(std::string("not a number"));
  EXPECT_THAT(decode_error<int>(bytes),
              AllOf(HasSubstr("holds a string at offset 4 where a signed integer was expected"),
                    HasSubstr("did every rank send the same type")));
}

TEST(CodecDecodeError, TypeMismatchMatrix) {
  EXPECT_THAT(decode_error<std::uint32_t>(mdist::to_bytes(std::int32_t{1})),
              HasSubstr("holds a signed integer at offset 4 where an unsigned integer was"));
  EXPECT_THAT(decode_error<double>(mdist::to_bytes(std::int64_t{1})),
              HasSubstr("where a floating-point number was expected"));
  EXPECT_THAT(decode_error<bool>(mdist::to_bytes(std::uint8_t{1})),
              HasSubstr("holds an unsigned integer at offset 4 where a bool was expected"));
  EXPECT_THAT(decode_error<std::vector<std::string>>(mdist::to_bytes(std::set<std::string>{})),
              HasSubstr("holds a set at offset 4 where a sequence was expected"));
  EXPECT_THAT(decode_error<std::vector<int>>(mdist::to_bytes(std::list<int>{1})),
              HasSubstr("holds a sequence at offset 4 where an array of numbers was expected"));
  EXPECT_THAT((decode_error<std::map<int, int>>(mdist::to_bytes(std::pair<int, int>{}))),
              HasSubstr("holds a pair at offset 4 where a map was expected"));
  EXPECT_THAT((decode_error<std::tuple<int, int>>(mdist::to_bytes(std::pair<int, int>{}))),
              HasSubstr("holds a pair at offset 4 where a tuple was expected"));
  EXPECT_THAT(decode_error<std::optional<int>>(mdist::to_bytes(1)),
              HasSubstr("where an optional was expected"));
  EXPECT_THAT(decode_error<at::Tensor>(mdist::to_bytes(std::vector<float>{1.0f})),
              HasSubstr("holds an array of numbers at offset 4 where a tensor was expected"));
  EXPECT_THAT((decode_error<std::array<int, 1>>(mdist::to_bytes(std::vector<int>{1}))),
              HasSubstr("where a fixed-size array was expected"));
  EXPECT_THAT(decode_error<std::set<int>>(mdist::to_bytes(at::ones({1}))),
              HasSubstr("holds a tensor at offset 4 where a set was expected"));
  EXPECT_THAT(decode_error<std::string>(mdist::to_bytes(true)),
              HasSubstr("holds a bool at offset 4 where a string was expected"));
  EXPECT_THAT((decode_error<std::pair<int, int>>(mdist::to_bytes(std::tuple<int, int>{}))),
              HasSubstr("holds a tuple at offset 4 where a pair was expected"));
  EXPECT_THAT(decode_error<std::optional<int>>(mdist::to_bytes(std::map<int, int>{})),
              HasSubstr("holds a map at offset 4"));
}

TEST(CodecDecodeError, MismatchDeepInsideReportsItsOffset) {
  const Bytes bytes = mdist::to_bytes(std::pair<int, std::string>{1, "x"});
  // pair tag at 4, int at 5..10, then the string's tag at 11.
  EXPECT_THAT((decode_error<std::pair<int, int>>(bytes)),
              HasSubstr("holds a string at offset 11 where a signed integer was expected"));
}

TEST(CodecDecodeError, UnknownTag) {
  Bytes bytes = mdist::to_bytes(1);
  bytes[kTagAt] = 0xEE;
  EXPECT_THAT(decode_error<int>(bytes), HasSubstr("holds an unknown tag at offset 4"));
  bytes[kTagAt] = 0;
  EXPECT_THAT(decode_error<int>(bytes), HasSubstr("holds an unknown tag at offset 4"));
}

TEST(CodecDecodeError, WidthMismatch) {
  EXPECT_THAT(decode_error<std::int64_t>(mdist::to_bytes(std::int32_t{1})),
              HasSubstr("a signed integer of 4 bytes where 8 were expected"));
  EXPECT_THAT(decode_error<std::int32_t>(mdist::to_bytes(std::int64_t{1})),
              HasSubstr("a signed integer of 8 bytes where 4 were expected"));
  EXPECT_THAT(decode_error<float>(mdist::to_bytes(1.0)),
              HasSubstr("a floating-point number of 8 bytes where 4 were expected"));
  EXPECT_THAT(decode_error<std::vector<double>>(mdist::to_bytes(std::vector<float>{1.0f})),
              HasSubstr("array of a floating-point number of width 4 where a floating-point "
                        "number of width 8 was expected"));
  EXPECT_THAT(decode_error<std::vector<std::uint32_t>>(mdist::to_bytes(std::vector<int>{1})),
              HasSubstr("array of a signed integer of width 4 where an unsigned integer"));
  // A width byte of a bool that is not 1.
  Bytes bad_bool = mdist::to_bytes(true);
  bad_bool[kTagAt + 1] = 4;
  EXPECT_THAT(decode_error<bool>(bad_bool), HasSubstr("a bool of 4 bytes where 1 were expected"));
}

TEST(CodecDecodeError, EnumWidthMismatch) {
  EXPECT_THAT(decode_error<Small>(mdist::to_bytes(Plain::kX)),
              HasSubstr("a signed integer of 4 bytes where 1 were expected"));
  EXPECT_THAT(decode_error<Wide>(mdist::to_bytes(Small::kMid)),
              HasSubstr("holds a signed integer at offset 4 where an unsigned integer"));
}

// ---- decode errors: invalid values ---------------------------------------------------------

TEST(CodecDecodeError, BoolByte) {
  Bytes bytes = mdist::to_bytes(true);
  bytes[kTagAt + 2] = 2;
  EXPECT_THAT(decode_error<bool>(bytes), HasSubstr("bool byte 2 is neither 0 nor 1"));
  bytes[kTagAt + 2] = 0xFF;
  EXPECT_THAT(decode_error<bool>(bytes), HasSubstr("bool byte 255 is neither 0 nor 1"));
  // Inside a vector<bool>, third element: tag, 8-byte count, then 3 bytes per bool.
  Bytes bits = mdist::to_bytes(std::vector<bool>{true, true, true});
  bits[kTagAt + 9 + 2 * 3 + 2] = 2;
  EXPECT_THAT(
      decode_error<std::vector<bool>>(bits),
      HasSubstr("corrupt at offset " + std::to_string(kTagAt + 9 + 2 * 3 + 3) + ": bool byte 2"));
}

TEST(CodecDecodeError, OptionalFlag) {
  Bytes bytes = mdist::to_bytes(std::optional<int>{});
  bytes[kTagAt + 1] = 2;
  EXPECT_THAT(decode_error<std::optional<int>>(bytes),
              HasSubstr("optional flag 2 is neither 0 nor 1"));
}

TEST(CodecDecodeError, TupleArity) {
  EXPECT_THAT((decode_error<std::tuple<int, int, int>>(mdist::to_bytes(std::tuple<int, int>{}))),
              HasSubstr("tuple of 2 elements where 3 were expected"));
  EXPECT_THAT((decode_error<std::tuple<>>(mdist::to_bytes(std::tuple<int>{}))),
              HasSubstr("tuple of 1 elements where 0 were expected"));
  Bytes bytes = mdist::to_bytes(std::tuple<int>{1});
  poke(bytes, kTagAt + 1, std::uint32_t{0xFFFFFFFF});
  EXPECT_THAT(decode_error<std::tuple<int>>(bytes),
              HasSubstr("tuple of 4294967295 elements where 1 were expected"));
}

TEST(CodecDecodeError, ArraySize) {
  EXPECT_THAT((decode_error<std::array<int, 3>>(mdist::to_bytes(std::array<int, 2>{}))),
              HasSubstr("array of 2 elements where 3 were expected"));
  EXPECT_THAT((decode_error<std::array<std::string, 1>>(
                  mdist::to_bytes(std::vector<std::string>{"a", "b"}))),
              HasSubstr("array of 2 elements where 1 were expected"));
}

TEST(CodecDecodeError, DuplicateSetElement) {
  // A sequence of two equal strings, retagged as a set.
  Bytes bytes = mdist::to_bytes(std::vector<std::string>{"dup", "dup"});
  bytes[kTagAt] = tag_byte(mdist::Tag::kSet);
  EXPECT_THAT(decode_error<std::set<std::string>>(bytes),
              HasSubstr("set holds a duplicate element"));
  EXPECT_THAT(decode_error<std::unordered_set<std::string>>(bytes),
              HasSubstr("set holds a duplicate element"));
}

TEST(CodecDecodeError, DuplicateMapKey) {
  const Bytes bytes = make_buffer([](mdist::ByteWriter& out) {
    out.write_tag(mdist::Tag::kMap);
    out.write_length(2);
    mdist::encode(out, std::string("k"));
    mdist::encode(out, 1);
    mdist::encode(out, std::string("k"));
    mdist::encode(out, 2);
  });
  EXPECT_THAT((decode_error<std::map<std::string, int>>(bytes)),
              HasSubstr("map holds a duplicate key"));
  EXPECT_THAT((decode_error<std::unordered_map<std::string, int>>(bytes)),
              HasSubstr("map holds a duplicate key"));
}

// A length field of 2^60 must be refused before anything of that size is allocated.
TEST(CodecDecodeError, HugeLengthsAreRefusedWithoutAllocating) {
  constexpr std::uint64_t kHuge = std::uint64_t{1} << 60;
  const auto expect_refused = [&](auto type_tag, Bytes bytes, std::size_t length_at,
                                  const std::string& what) {
    using T = typename decltype(type_tag)::type;
    poke(bytes, length_at, kHuge);
    const ScopedAllocationTracker tracker;
    EXPECT_THAT(decode_error<T>(bytes),
                HasSubstr(what + " length " + std::to_string(kHuge) + " at offset " +
                          std::to_string(length_at) + " exceeds the"));
    EXPECT_LT(tracker.largest(), 4096u) << what;
  };
  // tag(1) [+ kind(1) + width(1) for packed arrays], then the length.
  expect_refused(std::type_identity<std::string>{}, mdist::to_bytes(std::string("abc")), kTagAt + 1,
                 "string");
  expect_refused(std::type_identity<std::vector<double>>{},
                 mdist::to_bytes(std::vector<double>{1.0}), kTagAt + 3, "array");
  expect_refused(std::type_identity<std::vector<std::string>>{},
                 mdist::to_bytes(std::vector<std::string>{"a"}), kTagAt + 1, "sequence");
  expect_refused(std::type_identity<std::list<int>>{}, mdist::to_bytes(std::list<int>{1}),
                 kTagAt + 1, "sequence");
  expect_refused(std::type_identity<std::set<int>>{}, mdist::to_bytes(std::set<int>{1}), kTagAt + 1,
                 "set");
  expect_refused(std::type_identity<std::map<int, int>>{},
                 mdist::to_bytes(std::map<int, int>{{1, 2}}), kTagAt + 1, "map");
  expect_refused(std::type_identity<std::array<int, 1>>{}, mdist::to_bytes(std::array<int, 1>{}),
                 kTagAt + 1, "array");
  // The maximum 64-bit length, too.
  Bytes bytes = mdist::to_bytes(std::string("abc"));
  poke(bytes, kTagAt + 1, std::numeric_limits<std::uint64_t>::max());
  EXPECT_THAT(decode_error<std::string>(bytes), HasSubstr("exceeds the 3 bytes left"));
}

// A length that fits the bytes left but lies about the elements still fails cleanly.
TEST(CodecDecodeError, PlausibleButWrongLength) {
  Bytes bytes = mdist::to_bytes(std::vector<std::string>{"a", "b"});
  poke(bytes, kTagAt + 1, std::uint64_t{3});
  EXPECT_THAT(decode_error<std::vector<std::string>>(bytes), HasSubstr("truncated"));
  poke(bytes, kTagAt + 1, std::uint64_t{1});
  EXPECT_THAT(decode_error<std::vector<std::string>>(bytes), HasSubstr("trailing bytes"));
}

// A sequence length is bounded by the bytes left, but sizeof(T) may far exceed an element's
// encoding (8 KiB here against 9 bytes): reserving `length` elements up front would turn a
// 64 KiB buffer into a 512 MiB allocation.
TEST(CodecDecodeError, SequenceReservationIsBoundedByTheInput) {
  using Big = std::array<double, 1024>;
  Bytes bytes = mdist::to_bytes(std::vector<Big>{});
  bytes.resize(bytes.size() + 64 * 1024, 0);  // garbage the length may claim
  poke(bytes, kTagAt + 1, std::uint64_t{64 * 1024});
  const ScopedAllocationTracker tracker;
  EXPECT_THAT(decode_error<std::vector<Big>>(bytes), HasSubstr("where a fixed-size array"));
  EXPECT_LE(tracker.largest(), 2 * bytes.size());
}

// ---- decode errors: tensors ----------------------------------------------------------------

struct TensorHeader {
  std::int8_t dtype = static_cast<std::int8_t>(at::kFloat);
  std::uint8_t device = 0;
  std::vector<std::int64_t> sizes{};
  std::uint64_t nbytes = 0;
  std::size_t data_bytes = 0;  // zeros actually present after the length
};

Bytes tensor_buffer(const TensorHeader& h) {
  return make_buffer([&](mdist::ByteWriter& out) {
    out.write_tag(mdist::Tag::kTensor);
    out.write_raw(h.dtype);
    out.write_raw(h.device);
    out.write_raw(static_cast<std::uint32_t>(h.sizes.size()));
    for (const std::int64_t size : h.sizes) out.write_raw(size);
    out.write_length(h.nbytes);
    const std::vector<std::uint8_t> zeros(h.data_bytes, 0);
    out.write(zeros.data(), zeros.size());
  });
}

TEST(CodecTensorDecode, HandMadeBufferMatchesTheEncoder) {
  // Guards the hand-made layout that the error tests below rely on.
  const at::Tensor zeros = at::zeros({2, 3}, at::kFloat);
  EXPECT_EQ(tensor_buffer({.sizes = {2, 3}, .nbytes = 24, .data_bytes = 24}),
            mdist::to_bytes(zeros));
}

TEST(CodecTensorDecode, UnknownDtypeCode) {
  EXPECT_THAT(decode_error<at::Tensor>(tensor_buffer({.dtype = 100})),
              HasSubstr("unknown tensor dtype code 100"));
  EXPECT_THAT(decode_error<at::Tensor>(tensor_buffer({.dtype = -1})),
              HasSubstr("unknown tensor dtype code -1"));
  // A real ScalarType that the codec does not carry.
  const auto qint8 = static_cast<std::int8_t>(at::kQInt8);
  EXPECT_THAT(decode_error<at::Tensor>(tensor_buffer({.dtype = qint8})),
              HasSubstr("unknown tensor dtype code " + std::to_string(qint8)));
}

TEST(CodecTensorDecode, UnknownDevice) {
  EXPECT_THAT(decode_error<at::Tensor>(tensor_buffer({.device = 2})),
              HasSubstr("unknown tensor device code 2"));
}

#ifndef MDIST_HAS_CUDA
TEST(CodecTensorDecode, CudaTensorInACpuBuild) {
  EXPECT_THAT(decode_error<at::Tensor>(
                  tensor_buffer({.device = 1, .sizes = {1}, .nbytes = 4, .data_bytes = 4})),
              HasSubstr("a CUDA tensor arrived, but this mdist build has no CUDA support"));
}
#endif

TEST(CodecTensorDecode, NegativeSize) {
  EXPECT_THAT(decode_error<at::Tensor>(tensor_buffer({.sizes = {2, -1}})),
              HasSubstr("negative tensor size -1"));
  EXPECT_THAT(decode_error<at::Tensor>(
                  tensor_buffer({.sizes = {std::numeric_limits<std::int64_t>::min()}})),
              HasSubstr("negative tensor size"));
}

TEST(CodecTensorDecode, TooManyDimensions) {
  TensorHeader h;
  h.sizes.assign(65, 1);
  h.nbytes = 4;
  h.data_bytes = 4;
  EXPECT_THAT(decode_error<at::Tensor>(tensor_buffer(h)), HasSubstr("tensor has 65 dimensions"));
  // A huge dimension count is refused before the shape vector is allocated.
  Bytes bytes = tensor_buffer({});
  poke(bytes, kTagAt + 3, std::uint32_t{0xFFFFFFFF});
  const ScopedAllocationTracker tracker;
  EXPECT_THAT(decode_error<at::Tensor>(bytes), HasSubstr("tensor has 4294967295 dimensions"));
  EXPECT_LT(tracker.largest(), 4096u);
  // 64 is allowed.
  h.sizes.assign(64, 1);
  EXPECT_EQ(mdist::from_bytes<at::Tensor>(tensor_buffer(h)).dim(), 64);
}

TEST(CodecTensorDecode, ShapeOverflow) {
  EXPECT_THAT(decode_error<at::Tensor>(tensor_buffer({.sizes = {1LL << 40, 1LL << 40}})),
              HasSubstr("tensor shape is too large"));
  EXPECT_THAT(decode_error<at::Tensor>(
                  tensor_buffer({.sizes = {std::numeric_limits<std::int64_t>::max(), 2}})),
              HasSubstr("tensor shape is too large"));
  EXPECT_THAT(decode_error<at::Tensor>(
                  tensor_buffer({.sizes = {3, 3, 3, 1LL << 20, 1LL << 20, 1LL << 20}})),
              HasSubstr("tensor shape is too large"));
}

// The byte count is numel times the element size, which must not wrap (2^62 float32 elements
// would need 0 bytes); and a zero-size dimension must not hide huge others, which at::empty
// would overflow computing the strides. Either way at::empty would throw c10::Error, not
// DecodeError. (RandomBitFlips hits the first: one flipped bit in an empty tensor's shape.)
TEST(CodecTensorDecode, ShapeOverflowAfterElementSizeOrWithAZeroDimension) {
  EXPECT_THAT(decode_error<at::Tensor>(tensor_buffer({.sizes = {1LL << 62}})),
              HasSubstr("tensor shape is too large"));
  EXPECT_THAT(decode_error<at::Tensor>(tensor_buffer(
                  {.dtype = static_cast<std::int8_t>(at::kComplexDouble), .sizes = {1LL << 61}})),
              HasSubstr("tensor shape is too large"));
  EXPECT_THAT(decode_error<at::Tensor>(tensor_buffer({.sizes = {0, 1LL << 62, 1LL << 62}})),
              HasSubstr("tensor shape is too large"));
}

TEST(CodecTensorDecode, DataLengthMismatch) {
  EXPECT_THAT(
      decode_error<at::Tensor>(tensor_buffer({.sizes = {2, 3}, .nbytes = 23, .data_bytes = 23})),
      HasSubstr("tensor data of 23 bytes where its shape needs 24"));
  EXPECT_THAT(
      decode_error<at::Tensor>(tensor_buffer({.sizes = {2, 3}, .nbytes = 25, .data_bytes = 25})),
      HasSubstr("tensor data of 25 bytes where its shape needs 24"));
  EXPECT_THAT(decode_error<at::Tensor>(tensor_buffer({.sizes = {0}, .nbytes = 4, .data_bytes = 4})),
              HasSubstr("tensor data of 4 bytes where its shape needs 0"));
  // The right length with the data missing.
  EXPECT_THAT(
      decode_error<at::Tensor>(tensor_buffer({.sizes = {2, 3}, .nbytes = 24, .data_bytes = 10})),
      HasSubstr("truncated: tensor data needs 24 bytes"));
  // A huge shape whose bytes are claimed but absent is refused without allocating it.
  const ScopedAllocationTracker tracker;
  EXPECT_THAT(
      decode_error<at::Tensor>(tensor_buffer({.sizes = {1LL << 30, 16}, .nbytes = 1ULL << 36})),
      HasSubstr("truncated: tensor data needs 68719476736 bytes"));
  EXPECT_LT(tracker.largest(), 4096u);
}

// Like a scalar bool and vector<bool>, a bool tensor must hold only 0 and 1 bytes: anything
// else is a bool that is undefined behaviour to read.
TEST(CodecTensorDecode, BoolTensorBytes) {
  Bytes bytes = mdist::to_bytes(at::ones({3}, at::kBool));
  bytes.back() = 2;
  EXPECT_THAT(decode_error<at::Tensor>(bytes), HasSubstr("neither 0 nor 1"));
}

// ---- random corruption ---------------------------------------------------------------------

// Whatever a flipped bit does, decoding either succeeds or throws DecodeError.
TEST(CodecDecodeError, RandomBitFlips) {
  const Bytes valid = mdist::to_bytes(make_composite());
  std::mt19937_64 rng(20240611);
  int decoded = 0;
  int refused = 0;
  for (int iteration = 0; iteration < 4000; ++iteration) {
    Bytes bytes = valid;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i) {
      const std::size_t bit = rng() % (bytes.size() * 8);
      bytes[bit / 8] ^= static_cast<std::uint8_t>(1u << (bit % 8));
    }
    try {
      static_cast<void>(mdist::from_bytes<Composite>(bytes));
      ++decoded;
    } catch (const mdist::DecodeError& e) {
      EXPECT_THAT(e.what(), StartsWith("mdist: ")) << "iteration " << iteration;
      ++refused;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << iteration << ": not a DecodeError: " << e.what();
    }
  }
  // Most flips land in data (doubles, tensor bytes) and decode; many hit structure.
  EXPECT_GT(decoded, 0);
  EXPECT_GT(refused, 0);
}

// Random bytes after a valid header, decoded as several types.
TEST(CodecDecodeError, RandomGarbage) {
  std::mt19937_64 rng(7);
  for (int iteration = 0; iteration < 2000; ++iteration) {
    Bytes bytes(mdist::kObjectMagic.begin(), mdist::kObjectMagic.end());
    const std::size_t length = rng() % 64;
    for (std::size_t i = 0; i < length; ++i) bytes.push_back(static_cast<std::uint8_t>(rng()));
    // A valid tag in front gets the decoder past the first check more often.
    if (length > 0) bytes[kTagAt] = static_cast<std::uint8_t>(1 + rng() % 13);
    const auto attempt = [&](auto type_tag) {
      using T = typename decltype(type_tag)::type;
      try {
        static_cast<void>(mdist::from_bytes<T>(bytes));
      } catch (const mdist::DecodeError&) {
      } catch (const std::exception& e) {
        ADD_FAILURE() << "iteration " << iteration << ": not a DecodeError: " << e.what();
      }
    };
    attempt(std::type_identity<at::Tensor>{});
    attempt(std::type_identity<std::vector<std::string>>{});
    attempt(std::type_identity<std::map<std::string, std::vector<double>>>{});
    attempt(std::type_identity<std::tuple<bool, std::optional<int>>>{});
    attempt(std::type_identity<Stats>{});
  }
}

}  // namespace
