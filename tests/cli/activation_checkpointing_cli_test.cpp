// `mdist train --activation-checkpointing` end to end (real processes through mdistrun): on 2
// and 4 ranks as dp 2, tp 2 and, on the tiny Qwen3-MoE, ep 2, and with micro-batches in bf16, five
// steps with full and selective checkpointing give bit-identical losses, gradient norms and
// final weights to the run without; an unknown mode or a misplaced --ac-every is one line, exit 2,
// nothing written.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "mdist/hf/safetensors.h"
#include "tests/cli/mdist_command.h"

namespace {

namespace fs = std::filesystem;
using mdist::testing::error_lines;
using mdist::testing::MdistCommand;
using mdist::testing::RunResult;
using ::testing::HasSubstr;

class MdistActivationCheckpointing : public MdistCommand {
 protected:
  // A five-step run with `args`; returns its directory.
  fs::path train(const std::vector<std::string>& args, const std::string& name) {
    const auto out = dir_ / name;
    const RunResult r = mdist(
        2, train_args(with(args, {"--steps", "5", "--save-every", "0", "--out", out.string()})));
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    return out;
  }

  // The runs' metrics and final weights are the same bits.
  static void expect_identical(const fs::path& run, const fs::path& reference) {
    const auto got = metrics(run), expected = metrics(reference);
    ASSERT_EQ(got.size(), 5u) << run;
    ASSERT_EQ(got.size(), expected.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i]["loss"].get<double>(), expected[i]["loss"].get<double>()) << "step " << i;
      EXPECT_EQ(got[i]["grad_norm"].get<double>(), expected[i]["grad_norm"].get<double>())
          << "step " << i;
    }
    const mdist::hf::SafetensorsCheckpoint x(final_model(run)), y(final_model(reference));
    ASSERT_EQ(x.names(), y.names());
    for (const auto& name : x.names()) {
      EXPECT_TRUE(at::equal(x.tensor(name), y.tensor(name))) << name;
    }
  }

  static fs::path final_model(const fs::path& run) {
    char name[32];
    std::snprintf(name, sizeof(name), "step-%08d", 5);
    return run / "checkpoints" / name;
  }
};

TEST_F(MdistActivationCheckpointing, DenseDpAndTpAreBitIdentical) {
  for (const std::string tp : {"1", "2"}) {
    SCOPED_TRACE("tp " + tp);
    const auto reference = train({"--tp", tp}, "none-tp" + tp);
    const auto full = dir_ / ("full-tp" + tp);
    const RunResult r =
        mdist(2, train_args({"--tp", tp, "--steps", "5", "--save-every", "0",
                             "--activation-checkpointing", "full", "--out", full.string()}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_THAT(r.out, HasSubstr("activation checkpointing full: 4 of 4 decoder layers"));
    expect_identical(full, reference);
    expect_identical(
        train({"--tp", tp, "--activation-checkpointing", "selective", "--ac-every", "2"},
              "selective-tp" + tp),
        reference);
  }
}

// With gradient accumulation (a backward per micro-batch, the reduce-scatter after the last)
// and bf16 compute: still the same bits.
TEST_F(MdistActivationCheckpointing, MicroBatchesAndBf16AreBitIdentical) {
  const std::vector<std::string> common = {"--micro-batch", "1", "--param-dtype", "bf16"};
  const auto reference = train(common, "none");
  expect_identical(train(with(common, {"--activation-checkpointing", "full"}), "full"), reference);
}

TEST_F(MdistActivationCheckpointing, MoeEp2IsBitIdentical) {
  const auto model = qwen3_moe_model("moe", 4, 0.01);
  const std::vector<std::string> common = {"--model", model.string(), "--ep", "2"};
  const auto reference = train(common, "none");
  expect_identical(train(with(common, {"--activation-checkpointing", "full"}), "full"), reference);
}

// On 4 ranks as (dp 2, tp 2) on the default model and (dp 4 as ep 2 x edp 2) on the MoE.
TEST_F(MdistActivationCheckpointing, FourRanksDpTpAndDpEpAreBitIdentical) {
  const auto four = [&](const std::vector<std::string>& args, const std::string& name) {
    const auto out = dir_ / name;
    const RunResult r = mdist(
        4, train_args(with(args, {"--steps", "5", "--save-every", "0", "--out", out.string()})));
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    return out;
  };
  const std::vector<std::string> tp = {"--tp", "2"};
  expect_identical(four(with(tp, {"--activation-checkpointing", "full"}), "tp-full"),
                   four(tp, "tp-none"));
  const auto model = qwen3_moe_model("moe", 4, 0.01);
  const std::vector<std::string> ep = {"--model", model.string(), "--ep", "2"};
  expect_identical(four(with(ep, {"--activation-checkpointing", "full"}), "ep-full"),
                   four(ep, "ep-none"));
}

TEST_F(MdistActivationCheckpointing, BadModesAreOneLineAndWriteNothing) {
  const auto out = dir_ / "run";
  const struct {
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {{"--activation-checkpointing", "op"},
       "--activation-checkpointing must be none, full or selective, got 'op'"},
      {{"--activation-checkpointing", "full", "--ac-every", "2"},
       "--ac-every applies to --activation-checkpointing selective only"},
      {{"--activation-checkpointing", "selective", "--ac-every", "0"}, "--ac-every"},
  };
  for (const auto& c : cases) {
    const RunResult r = mdist(2, train_args(with(c.args, {"--out", out.string()})));
    EXPECT_EQ(r.exit_code, 2) << describe(r);
    EXPECT_THAT(r.err, HasSubstr("[rank0]: mdist train: error: " + c.message)) << r.err;
    EXPECT_EQ(error_lines(r.err), 1) << r.err;
    EXPECT_FALSE(fs::exists(out)) << "output left behind: " << out;
  }
}

}  // namespace
