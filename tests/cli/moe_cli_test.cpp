// Mixtures of experts in the `mdist` command end to end (real processes through mdistrun):
// calibration with and without expert parallelism (--ep), modelopt's completeness rule for
// experts that got no calibration tokens, and --ep's bad input.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "mdist/hf/safetensors.h"
#include "tests/cli/mdist_command.h"
#include "tests/support/subprocess.h"

namespace {

namespace fs = std::filesystem;
using mdist::testing::MdistCommand;
using mdist::testing::RunResult;
using ::testing::HasSubstr;
using ::testing::Not;

class MdistMoe : public MdistCommand {
 protected:
  static nlohmann::json read_json(const fs::path& path) {
    std::ifstream in(path);
    return nlohmann::json::parse(in);
  }

  // Every module's two maxima equal within `relative` (null only where the other is null).
  static void expect_same_modules(const nlohmann::json& a, const nlohmann::json& b, double relative,
                                  const std::string& what) {
    ASSERT_EQ(a["modules"].size(), b["modules"].size()) << what;
    for (const auto& [name, value] : a["modules"].items()) {
      ASSERT_TRUE(b["modules"].contains(name)) << what << ": " << name;
      for (const char* key : {"input_absmax", "weight_absmax"}) {
        const auto& x = value[key];
        const auto& y = b["modules"][name][key];
        ASSERT_EQ(x.is_null(), y.is_null()) << what << ": " << name << " " << key;
        if (x.is_null()) continue;
        const double u = x.get<double>(), v = y.get<double>();
        EXPECT_LE(std::abs(u - v), relative * std::max(std::abs(u), std::abs(v)))
            << what << ": " << name << " " << key << " " << u << " vs " << v;
      }
    }
  }

  static std::vector<std::string> calibrate_args(const fs::path& model, const fs::path& out,
                                                 std::vector<std::string> more) {
    std::vector<std::string> args = {"calibrate", "--model", model.string(), "--seq-len",
                                     "32",        "--out",   out.string()};
    args.insert(args.end(), more.begin(), more.end());
    return args;
  }
};

// The calibration JSON of a MoE is the same on 1 rank and on 4 ranks as (dp, ep) = (4, 1),
// (4, 2) and (4, 4) (1e-6 relative; the tokens routed to each expert exactly), and holds what
// the model and its checkpoint say: every expert's weight maxima are those of its tensors in the
// safetensors files, each expert's gate_proj and up_proj see the same rows, the experts of a
// layer together see every token the router saw, and the routed counts add up to
// sequences x seq_len x top_k.
TEST_F(MdistMoe, CalibrationIsTheSameOnEveryExpertParallelLayout) {
  const auto model = qwen3_moe_model("moe", 8);
  const auto single = dir_ / "np1.json";
  auto r = mdist(1, calibrate_args(model, single, {"--max-sequences", "8"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto reference = read_json(single);

  const mdist::hf::SafetensorsCheckpoint checkpoint(model);
  int experts_checked = 0;
  for (int layer = 0; layer < 2; ++layer) {
    const std::string block = "model.layers." + std::to_string(layer) + ".mlp";
    const auto& modules = reference["modules"];
    const auto& counts = reference["expert_tokens"][block + ".experts"];
    ASSERT_EQ(counts.size(), 8u) << reference.dump(1);
    std::int64_t routed = 0;
    double widest = 0;
    for (int e = 0; e < 8; ++e) {
      const std::string expert = block + ".experts." + std::to_string(e);
      routed += counts[e].get<std::int64_t>();
      ASSERT_GT(counts[e].get<std::int64_t>(), 0) << expert;
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
        const std::string name = expert + "." + proj;
        ASSERT_TRUE(modules.contains(name)) << name;
        const at::Tensor weight = checkpoint.tensor(name + ".weight").to(at::kDouble);
        EXPECT_EQ(modules[name]["weight_absmax"].get<double>(), weight.abs().max().item<double>())
            << name;
        ++experts_checked;
      }
      EXPECT_EQ(modules[expert + ".gate_proj"]["input_absmax"],
                modules[expert + ".up_proj"]["input_absmax"]);
      widest = std::max(widest, modules[expert + ".gate_proj"]["input_absmax"].get<double>());
    }
    EXPECT_EQ(routed, 8 * 32 * 2);
    EXPECT_EQ(widest, modules[block + ".gate"]["input_absmax"].get<double>()) << block;
  }
  EXPECT_EQ(experts_checked, 2 * 8 * 3);

  for (const int ep : {1, 2, 4}) {
    const auto out = dir_ / ("ep" + std::to_string(ep) + ".json");
    r = mdist(4, calibrate_args(model, out, {"--max-sequences", "8", "--ep", std::to_string(ep)}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    if (ep > 1) {
      EXPECT_THAT(r.out, HasSubstr("experts over ep " + std::to_string(ep) + " x edp " +
                                   std::to_string(4 / ep)));
    }
    const auto result = read_json(out);
    expect_same_modules(reference, result, 1e-6, "ep " + std::to_string(ep));
    EXPECT_EQ(result["expert_tokens"], reference["expert_tokens"]) << "ep " << ep;
  }

  // 3 sequences on 4 ranks: rank 3 runs a padding forward, yet holds experts the others send
  // real tokens to (and, with ep 4, is their only rank): its record of them counts, and its
  // padding sends none. (--allow-incomplete-moe: with ep 2 an expert may miss tokens on one
  // of its two ranks.)
  const auto three = dir_ / "three.json";
  r = mdist(1, calibrate_args(model, three, {"--max-sequences", "3", "--allow-incomplete-moe"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto reference3 = read_json(three);
  for (const int ep : {2, 4}) {
    const auto out = dir_ / ("three-ep" + std::to_string(ep) + ".json");
    r = mdist(4, calibrate_args(model, out,
                                {"--max-sequences", "3", "--ep", std::to_string(ep),
                                 "--allow-incomplete-moe"}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    const auto result = read_json(out);
    expect_same_modules(reference3, result, 1e-6, "3 sequences, ep " + std::to_string(ep));
    EXPECT_EQ(result["expert_tokens"], reference3["expert_tokens"]) << "ep " << ep;
  }
}

// An expert no calibration token reached makes the calibration incomplete: one line naming
// it, exit code 2, no file; --allow-incomplete-moe writes the JSON (null input maxima exactly for
// the experts no token reached) and reports them. Under expert parallelism an expert that saw
// tokens on some of its ranks but not on others is incomplete too, as modelopt raises: here
// ranks 2 and 3 have no sequence, so the experts they hold saw none there.
TEST_F(MdistMoe, AnExpertWithoutCalibrationTokensIsAnErrorUnlessAllowed) {
  const auto model = qwen3_moe_model("moe", 8);
  const auto out = dir_ / "out" / "calibration.json";
  // 2 tokens x top-2 reach at most 4 of 8 experts.
  const std::vector<std::string> tiny = {"--seq-len", "2", "--max-sequences", "1"};
  auto args = calibrate_args(model, out, {});
  args.insert(args.end(), tiny.begin(), tiny.end());
  auto r = mdist(1, args);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("mdist calibrate: error: MoE calibration incomplete: "));
  EXPECT_THAT(r.err, HasSubstr("received no calibration tokens on some or all of their ranks: "
                               "model.layers.0.mlp.experts."));
  EXPECT_THAT(r.err, HasSubstr("(no tokens on its rank)"));
  EXPECT_THAT(r.err, HasSubstr("increase the calibration data (--data, --max-sequences) or pass "
                               "--allow-incomplete-moe"));
  EXPECT_FALSE(fs::exists(out));

  args.push_back("--allow-incomplete-moe");
  r = mdist(1, args);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("warning: MoE calibration incomplete (--allow-incomplete-moe)"));
  const auto result = read_json(out);
  int without = 0;
  for (int layer = 0; layer < 2; ++layer) {
    const std::string block = "model.layers." + std::to_string(layer) + ".mlp.experts";
    const auto& counts = result["expert_tokens"][block];
    for (int e = 0; e < 8; ++e) {
      const std::string expert = block + "." + std::to_string(e);
      const bool none = counts[e].get<std::int64_t>() == 0;
      without += none;
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
        const auto& module = result["modules"][expert + "." + proj];
        EXPECT_EQ(module["input_absmax"].is_null(), none) << expert;
        EXPECT_FALSE(module["weight_absmax"].is_null()) << expert;
      }
      if (none) {
        EXPECT_THAT(r.out, HasSubstr(expert + " (no tokens on its rank)"));
      }
    }
  }
  EXPECT_GE(without, 2 * 4);

  // Expert parallel: 2 sequences on 4 ranks as ep 2 x edp 2.
  const auto single = dir_ / "single.json", split = dir_ / "split.json";
  r = mdist(1, calibrate_args(model, single, {"--max-sequences", "2"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  r = mdist(4, calibrate_args(model, split, {"--max-sequences", "2", "--ep", "2"}));
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(
      r.err,
      HasSubstr("[rank0]: mdist calibrate: error: MoE calibration incomplete: 16 "
                "expert(s) received no calibration tokens on some or all of their "
                "ranks: model.layers.0.mlp.experts.0 (no tokens on rank 2 of its ranks 0,2)"));
  EXPECT_THAT(r.err, Not(HasSubstr("[rank1]")));
  EXPECT_FALSE(fs::exists(split));
  r = mdist(4, calibrate_args(model, split,
                              {"--max-sequences", "2", "--ep", "2", "--allow-incomplete-moe"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto whole = read_json(single), parts = read_json(split);
  expect_same_modules(whole, parts, 1e-6, "ep 2 of 2 sequences");
  EXPECT_EQ(whole["expert_tokens"], parts["expert_tokens"]);
}

// --ep that does not fit the world, the data-parallel size or the model: one line from rank 0,
// exit code 2, nothing written.
TEST_F(MdistMoe, BadExpertParallelSizesAreOneLine) {
  const auto six = qwen3_moe_model("six", 6);
  const auto out = dir_ / "result.json";
  const struct {
    int ranks;
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {4, calibrate_args(six, out, {"--ep", "3"}),
       "mdist calibrate: error: --ep 3 does not divide the data-parallel size 4 (world 4 / tp 1)"},
      {2, calibrate_args(six, out, {"--ep", "0"}),
       "mdist calibrate: error: --ep must be at least 1, got 0"},
      {4, calibrate_args(six, out, {"--ep", "4"}),
       "mdist calibrate: error: --ep 4: num_experts 6 is not divisible by 4"},
      {2,
       {"calibrate", "--seq-len", "32", "--ep", "2", "--out", out.string()},
       "mdist calibrate: error: --ep 2: the model (llama) has no mixture-of-experts layers to "
       "split"},
      {2,
       {"eval", "--seq-len", "32", "--ep", "2", "--out", out.string()},
       "mdist eval: error: --ep 2: the model (llama) has no mixture-of-experts layers to split"},
      {4,
       {"info", "--ep", "3"},
       "mdist info: error: --ep 3 does not divide the data-parallel size 4"},
  };
  for (const auto& c : cases) {
    const RunResult r = mdist(c.ranks, c.args);
    EXPECT_EQ(r.exit_code, 2) << describe(r);
    EXPECT_THAT(r.err, HasSubstr(c.message)) << describe(r);
    EXPECT_THAT(r.err, Not(HasSubstr("[rank1]"))) << describe(r);
    EXPECT_FALSE(fs::exists(out)) << c.message;
  }
}

// eval's loss on a MoE does not depend on the expert-parallel layout (each expert's rows are
// computed on its rank; padding forwards of ranks without sequences change nothing).
TEST_F(MdistMoe, EvalIsTheSameOnEveryExpertParallelLayout) {
  const auto model = qwen3_moe_model("moe", 8);
  const auto single = dir_ / "np1.json";
  auto r =
      mdist(1, {"eval", "--model", model.string(), "--seq-len", "32", "--out", single.string()});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const double loss = read_json(single)["loss"].get<double>();
  for (const int ep : {2, 4}) {
    const auto out = dir_ / ("ep" + std::to_string(ep) + ".json");
    r = mdist(4, {"eval", "--model", model.string(), "--seq-len", "32", "--ep", std::to_string(ep),
                  "--out", out.string()});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    const auto result = read_json(out);
    EXPECT_NEAR(result["loss"].get<double>(), loss, 1e-9 * loss) << "ep " << ep;
    EXPECT_EQ(result["tokens"], read_json(single)["tokens"]);
  }
}

// `mdist info --ep` lists the expert-parallel and expert-data-parallel groups.
TEST_F(MdistMoe, InfoShowsTheExpertGroups) {
  const RunResult r = mdist(4, {"info", "--ep", "2"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("layout: 4 rank(s) as dp 4 x tp 1, experts over ep 2 x edp 2"));
  EXPECT_THAT(r.out, HasSubstr("expert-parallel groups: [0,1] [2,3]"));
  EXPECT_THAT(r.out, HasSubstr("expert-data-parallel groups: [0,2] [1,3]"));
}

}  // namespace
