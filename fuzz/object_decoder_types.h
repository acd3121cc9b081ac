#pragma once
// The types the object decoder fuzzer decodes, shared by the fuzzer and the seed writer so
// that a seed's first byte selects the type it was encoded from.
#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "mdist/objects/codec.h"

namespace mdist_fuzz {

// A user type through the documented extension point (mdist/objects/codec.h).
struct Stats {
  double amax = 0;
  std::string name;
  std::vector<std::int32_t> counts;
};

enum class Phase : std::int8_t { kWarmup = 1, kTrain = 2, kEval = 3 };

// Deep enough to exercise every container codec inside every other.
using Nested = std::map<
    std::string,
    std::vector<std::optional<std::tuple<std::int32_t, std::vector<float>, std::set<std::string>,
                                         std::pair<bool, at::Tensor>, std::list<Phase>>>>>;

using MixedTuple = std::tuple<std::int8_t, std::uint64_t, float, double, std::string, bool, char,
                              std::tuple<>, Phase>;

// The first input byte, modulo the count, picks the type.
using DecodeTypes = std::tuple<
    at::Tensor,                                                                             // 0
    std::vector<at::Tensor>,                                                                // 1
    Nested,                                                                                 // 2
    std::map<std::string, std::vector<double>>,                                             // 3
    MixedTuple,                                                                             // 4
    std::optional<std::pair<std::vector<std::string>, std::int64_t>>,                       // 5
    std::set<std::string>,                                                                  // 6
    Stats,                                                                                  // 7
    std::vector<Stats>,                                                                     // 8
    std::unordered_map<std::int64_t, std::deque<std::uint16_t>>,                            // 9
    std::array<std::optional<std::vector<bool>>, 3>,                                        // 10
    std::vector<std::vector<std::int32_t>>,                                                 // 11
    std::string,                                                                            // 12
    std::unordered_set<std::string>,                                                        // 13
    std::map<std::string, std::optional<std::tuple<int, std::vector<float>, std::string>>>  // 14
    >;
inline constexpr std::size_t kTypeCount = std::tuple_size_v<DecodeTypes>;
template <std::size_t I>
using DecodeType = std::tuple_element_t<I, DecodeTypes>;

// How much a successful decode pins down the encoding, which the fuzzer checks:
//   kCanonical:   one encoding per value, so re-encoding gives back the very input;
//   kStable:      sets and maps accept their elements in any order, but re-encode sorted,
//                 so encode(decode(encode(v))) == encode(v);
//   kHashOrdered: unordered containers re-encode in hash-table order, which depends on the
//                 insertion history, so only the values can be compared.
// A composite is the weakest of itself and its parts.
enum class Encoding { kHashOrdered = 0, kStable = 1, kCanonical = 2 };

template <class T>
struct EncodingOf : std::integral_constant<Encoding, Encoding::kCanonical> {};
template <class... Ts>
inline constexpr Encoding kWeakest = std::min({Encoding::kCanonical, EncodingOf<Ts>::value...});
template <class... Ts>
struct EncodingOf<std::tuple<Ts...>> : std::integral_constant<Encoding, kWeakest<Ts...>> {};
template <class A, class B>
struct EncodingOf<std::pair<A, B>> : std::integral_constant<Encoding, kWeakest<A, B>> {};
template <class T>
struct EncodingOf<std::optional<T>> : EncodingOf<T> {};
template <class T, class A>
struct EncodingOf<std::vector<T, A>> : EncodingOf<T> {};
template <class T, class A>
struct EncodingOf<std::list<T, A>> : EncodingOf<T> {};
template <class T, class A>
struct EncodingOf<std::deque<T, A>> : EncodingOf<T> {};
template <class T, std::size_t N>
struct EncodingOf<std::array<T, N>> : EncodingOf<T> {};
template <class T, class C, class A>
struct EncodingOf<std::set<T, C, A>>
    : std::integral_constant<Encoding, std::min(Encoding::kStable, EncodingOf<T>::value)> {};
template <class K, class V, class C, class A>
struct EncodingOf<std::map<K, V, C, A>>
    : std::integral_constant<Encoding, std::min({Encoding::kStable, kWeakest<K, V>})> {};
template <class T, class H, class E, class A>
struct EncodingOf<std::unordered_set<T, H, E, A>>
    : std::integral_constant<Encoding, Encoding::kHashOrdered> {};
template <class K, class V, class H, class E, class A>
struct EncodingOf<std::unordered_map<K, V, H, E, A>>
    : std::integral_constant<Encoding, Encoding::kHashOrdered> {};

// Calls f.template operator()<T>() for the index-th type of DecodeTypes.
template <class F>
void visit_decode_type(std::size_t index, F&& f) {
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    static_cast<void>(
        ((index == I ? (f.template operator()<DecodeType<I>>(), true) : false) || ...));
  }
  (std::make_index_sequence<kTypeCount>{});
}

}  // namespace mdist_fuzz

template <>
struct mdist::Codec<mdist_fuzz::Stats> {
  static void encode(mdist::ByteWriter& out, const mdist_fuzz::Stats& s) {
    mdist::encode(out, s.amax);
    mdist::encode(out, s.name);
    mdist::encode(out, s.counts);
  }
  static mdist_fuzz::Stats decode(mdist::ByteReader& in) {
    mdist_fuzz::Stats s;
    s.amax = mdist::decode<double>(in);
    s.name = mdist::decode<std::string>(in);
    s.counts = mdist::decode<std::vector<std::int32_t>>(in);
    return s;
  }
};
