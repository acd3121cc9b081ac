// Runtime functions and object collectives across real ranks (run by mdistrun with 1-4 ranks).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

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
  if (mdist::size() == 1) {
    // The reference returns obj in a world of one, whatever src is.
    EXPECT_EQ(mdist::broadcast(1, 5), 1);
    return;
  }
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

// The reference's broadcast_state_dict: every dtype and shape, from every source, also over a
// subgroup whose group ranks differ from the global ones.
TEST(Objects, BroadcastStateDictFromEverySource) {
  const int me = mdist::rank();
  const int world = mdist::size();
  std::vector<int> reversed;
  for (int r = world - 1; r >= 0; --r) reversed.push_back(r);
  const mdist::Group backwards = mdist::new_group(reversed);
  for (const mdist::Group& group : {mdist::Group::world(), backwards}) {
    for (int src = 0; src < world; ++src) {
      torch::manual_seed(100 + src);
      const std::map<std::string, at::Tensor> sent = {
          {"a.weight", at::randn({3, 4})},
          {"b.half", at::randn({5}).to(at::kBFloat16)},
          {"c.step", at::scalar_tensor(int64_t{41} + src, at::kLong)},
          {"d.mask", at::rand({2, 2}) > 0.5},
          {"e.transposed", at::randn({4, 3}).t()},
          {"f.empty", at::empty({0, 3})},
          {"g.fp8", at::randn({6}).to(at::kFloat8_e4m3fn)},
      };
      // What a non-source passes is ignored, also a dict of its own.
      const std::map<std::string, at::Tensor> other = {{"zzz", at::ones({1})}};
      const auto* mine = me == src ? &sent : (me % 2 == 0 ? nullptr : &other);
      const auto got = mdist::broadcast_state_dict(mine, src, at::kCPU, group);
      ASSERT_EQ(got.size(), sent.size());
      for (const auto& [name, tensor] : sent) {
        ASSERT_TRUE(got.contains(name)) << name;
        const at::Tensor& t = got.at(name);
        EXPECT_EQ(t.scalar_type(), tensor.scalar_type()) << name;
        EXPECT_EQ(t.sizes(), tensor.sizes()) << name;
        // Bit for bit, compared as bytes (float8 has no equality kernel).
        EXPECT_TRUE(at::equal(t.contiguous().reshape({-1}).view(at::kByte),
                              tensor.contiguous().reshape({-1}).view(at::kByte)))
            << name << " from " << src;
      }
      if (me == src) {
        EXPECT_TRUE(got.at("a.weight").is_same(sent.at("a.weight")));
      }
    }
  }
}

TEST(Objects, BroadcastStateDictErrorsAreRaisedOnEveryRank) {
  const int world = mdist::size();
  const int src = world - 1;
  EXPECT_THAT(error_of([&] { mdist::broadcast_state_dict(nullptr, src, at::kCPU); }),
              HasSubstr("broadcast_state_dict: src rank " + std::to_string(src) +
                        " passed no state dict to broadcast"));
  const std::map<std::string, at::Tensor> undefined = {{"x", at::Tensor()}};
  EXPECT_THAT(error_of([&] { mdist::broadcast_state_dict(&undefined, src, at::kCPU); }),
              HasSubstr("broadcast_state_dict: tensor 'x' is undefined"));
  EXPECT_THAT(error_of([&] { mdist::broadcast_state_dict(&undefined, world, at::kCPU); }),
              world == 1 ? HasSubstr("tensor 'x' is undefined")
                         : HasSubstr("src " + std::to_string(world) + " is out of range"));
  // Nothing was left half-sent: the next collective still matches on every rank.
  EXPECT_EQ(mdist::allreduce(1), world);
}

// The reference's FileLock between real processes: with all_acquire every rank's
// read-modify-write of one counter file happens alone, so no increment is lost.
TEST(FileLock, RanksTakeTurns) {
  const int world = mdist::size();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("mdist-file-lock-" + std::string(std::getenv("MASTER_PORT")));
  const std::filesystem::path counter = dir / "counter";
  const std::filesystem::path inside = dir / "inside";
  if (mdist::rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    std::ofstream(counter) << 0;
  }
  mdist::barrier();
  constexpr int kRounds = 25;
  int overlaps = 0;
  for (int round = 0; round < kRounds; ++round) {
    mdist::FileLock lock(dir / "counter.lock",
                         {.all_acquire = true, .poll_time = std::chrono::milliseconds(1)});
    ASSERT_TRUE(lock.acquire());
    // Exclusive creation of a marker, held while inside: it fails if another rank is in too.
    mdist::FileLock marker(inside);
    if (!marker.try_acquire()) ++overlaps;
    int value = 0;
    std::ifstream(counter) >> value;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::ofstream(counter) << value + 1;
  }  // the marker, then the lock, are released here
  EXPECT_EQ(overlaps, 0);
  mdist::barrier();
  int total = 0;
  std::ifstream(counter) >> total;
  EXPECT_EQ(total, kRounds * world);
  EXPECT_FALSE(std::filesystem::exists(dir / "counter.lock"));
  mdist::barrier();
  if (mdist::rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace
