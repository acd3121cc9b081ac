// Runtime functions and object collectives across real ranks (run by mdistrun with 1-4 ranks).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdlib>

#include "mdist/mdist.h"
#include "tests/support/error_of.h"

namespace {

using ::testing::HasSubstr;

int env_int(const char* name) { return std::atoi(std::getenv(name)); }

using mdist::testing::error_of;

TEST(Runtime, MatchesTheLauncher) {
  ASSERT_TRUE(mdist::is_initialized());
  EXPECT_EQ(mdist::backend(), "gloo");
  EXPECT_EQ(mdist::size(), env_int("WORLD_SIZE"));
  EXPECT_EQ(mdist::rank(), env_int("RANK"));
  EXPECT_EQ(mdist::local_rank(), env_int("LOCAL_RANK"));
  EXPECT_EQ(mdist::local_size(), env_int("LOCAL_WORLD_SIZE"));
  EXPECT_EQ(mdist::is_master(), mdist::rank() == 0);
  EXPECT_EQ(mdist::is_last_process(), mdist::rank() == mdist::size() - 1);
  EXPECT_EQ(mdist::launch_env()->source, mdist::LaunchSource::kTorchrun);
  mdist::barrier();
  mdist::barrier(mdist::Group::world());
}

TEST(Objects, AllgatherEveryTypeWithSizesThatDifferPerRank) {
  const int me = mdist::rank();
  const int world = mdist::size();
  using Record = std::tuple<int64_t, std::string, std::vector<double>,
                            std::map<std::string, std::optional<std::pair<bool, float>>>>;
  std::map<std::string, std::optional<std::pair<bool, float>>> table;
  for (int i = 0; i <= me; ++i)
    table["k" + std::to_string(i)] = std::make_pair(i % 2 == 0, 0.5f * i);
  if (me % 2 == 1) table["empty"] = std::nullopt;
  const Record mine{me * 1000LL, std::string(static_cast<std::size_t>(me) * 300, 'a' + me),
                    std::vector<double>(static_cast<std::size_t>(me), me + 0.25), table};
  const auto all = mdist::allgather(mine);
  ASSERT_EQ(static_cast<int>(all.size()), world);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(std::get<0>(all[r]), r * 1000LL);
    EXPECT_EQ(std::get<1>(all[r]), std::string(static_cast<std::size_t>(r) * 300, 'a' + r));
    EXPECT_EQ(std::get<2>(all[r]), std::vector<double>(static_cast<std::size_t>(r), r + 0.25));
    EXPECT_EQ(std::get<3>(all[r]).size(), static_cast<std::size_t>(r + 1 + r % 2));
  }
  EXPECT_EQ(mdist::allgather(me % 2 == 0), [&] {
    std::vector<bool> expected;
    for (int r = 0; r < world; ++r) expected.push_back(r % 2 == 0);
    return expected;
  }());
}

TEST(Objects, AllgatherTensorsOfAnyDtypeAndShape) {
  const int me = mdist::rank();
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kLong, at::kBool};
  const at::Tensor mine = (at::arange((me + 1) * 3).reshape({me + 1, 3}) + me).to(dtypes[me % 4]);
  const auto all = mdist::allgather(mine);
  for (int r = 0; r < mdist::size(); ++r) {
    const at::Tensor expected = (at::arange((r + 1) * 3).reshape({r + 1, 3}) + r).to(dtypes[r % 4]);
    EXPECT_EQ(all[r].scalar_type(), expected.scalar_type());
    EXPECT_EQ(all[r].sizes(), expected.sizes());
    EXPECT_TRUE(at::equal(all[r], expected)) << "tensor from rank " << r;
  }
}

TEST(Objects, BroadcastFromEverySource) {
  for (int src = 0; src < mdist::size(); ++src) {
    const std::string big(static_cast<std::size_t>(1 << 20) + src, static_cast<char>('A' + src));
    const std::string mine = mdist::rank() == src ? big : std::string("not the source");
    EXPECT_EQ(mdist::broadcast(mine, src), big) << "src " << src;
  }
  const auto tensor = mdist::broadcast(at::full({2, 2}, mdist::rank() + 1.0), mdist::size() - 1);
  EXPECT_TRUE(at::equal(tensor, at::full({2, 2}, static_cast<double>(mdist::size()))));
  EXPECT_THAT(error_of([] { mdist::broadcast(1, mdist::size()); }),
              HasSubstr("broadcast: src " + std::to_string(mdist::size()) +
                        " is out of range for the world of size " + std::to_string(mdist::size())));
  EXPECT_THAT(error_of([] { mdist::broadcast(1, -1); }), HasSubstr("src -1 is out of range"));
}

TEST(Objects, AllreduceAndMasterOnly) {
  const int me = mdist::rank();
  const int world = mdist::size();
  EXPECT_EQ(mdist::allreduce(me + 1), world * (world + 1) / 2);
  EXPECT_DOUBLE_EQ(mdist::allreduce(0.5 * me, "max"), 0.5 * (world - 1));
  EXPECT_EQ(mdist::allreduce(std::string(1, 'a' + me), "min"), "a");
  EXPECT_EQ(mdist::allreduce(std::string(1, 'a' + me)), [&] {
    std::string all;
    for (int r = 0; r < world; ++r) all += static_cast<char>('a' + r);
    return all;
  }());
  const at::Tensor sum = mdist::allreduce(at::full({3}, me + 1.0));
  EXPECT_TRUE(at::allclose(sum, at::full({3}, world * (world + 1) / 2.0)));
  EXPECT_EQ(mdist::master_only([&] { return std::vector<int>{me, 7}; }), (std::vector<int>{0, 7}));
  int calls = 0;
  mdist::master_only([&] { ++calls; });
  EXPECT_EQ(calls, me == 0 ? 1 : 0);
}

}  // namespace

// A user type made sendable by specialising mdist::Codec, as codec.h documents.
struct Calibration {
  std::string module;
  double amax = 0;
  bool operator==(const Calibration&) const = default;
};
template <>
struct mdist::Codec<Calibration> {
  static void encode(mdist::ByteWriter& out, const Calibration& value) {
    mdist::encode(out, value.module);
    mdist::encode(out, value.amax);
  }
  static Calibration decode(mdist::ByteReader& in) {
    Calibration value;
    value.module = mdist::decode<std::string>(in);
    value.amax = mdist::decode<double>(in);
    return value;
  }
};

namespace {
TEST(Objects, UserTypesThroughTheExtensionPoint) {
  const auto all = mdist::allgather(Calibration{"layer" + std::to_string(mdist::rank()), 1.5});
  for (int r = 0; r < mdist::size(); ++r) {
    EXPECT_EQ(all[r], (Calibration{"layer" + std::to_string(r), 1.5}));
  }
}
}  // namespace
