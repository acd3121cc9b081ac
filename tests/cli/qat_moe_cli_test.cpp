// `mdist train --quant` on a mixture of experts, end to end through mdistrun, against modelopt
// 0.47's QAT of the tiny fp32 Qwen3-MoE of tests/quant/fixtures/ptq_qwen3_moe
// (make_qat_fixtures.py's qat_qwen3_moe: transformers 5's fused experts, one input quantizer
// per fused projection shared by a block's experts, a weight quantizer per expert):
//  - fp8 and int8, 5 steps: the losses (1e-5 relative), every parameter (1e-5) and the frozen
//    quantizer state under modelopt's fused names (1e-5 relative) on 1 rank, FSDP2 over 2 ranks
//    and expert parallelism (--ep 2: each expert's weight quantizer on the rank that holds it);
//  - --resume in the middle on the same and another layout (1 rank <-> --ep 2): the losses and
//    weights of the uninterrupted run (1e-6);
//  - --export-quantized of an fp8 run equal byte for byte to `mdist quantize --from-run`, on
//    1 rank and under --ep 2;
//  - what is not compared with modelopt (other formats, --kv-cache, --param-dtype, --teacher, a
//    quantized export as --model) is one line, exit 2, nothing written.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "mdist/hf/safetensors.h"
#include "tests/cli/mdist_command.h"
#include "tests/quant/ptq_fixture.h"

namespace mdist::testing {
namespace {

using ::testing::HasSubstr;

const fs::path kFixtures = fs::path(MDIST_QUANT_FIXTURES);
const fs::path kModel = kFixtures / "ptq_qwen3_moe";
const fs::path kExpected = kFixtures / "qat_qwen3_moe" / "expected.safetensors";

class QatMoeCommand : public MdistCommand {
 protected:
  // The fixture's training windows as a .u32 token file, in file order.
  fs::path train_data() {
    const fs::path path = dir_ / "train.u32";
    if (fs::exists(path)) return path;
    const hf::SafetensorsFile file(kExpected);
    const at::Tensor ids = file.tensor("train_ids").to(at::kInt).contiguous().flatten();
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(ids.data_ptr<int32_t>()),
              static_cast<std::streamsize>(ids.numel() * sizeof(int32_t)));
    return path;
  }

  // make_qat_fixtures.py's constants as flags, then `more`.
  std::vector<std::string> qat_args(const fs::path& out, const std::vector<std::string>& more,
                                    bool model = true) {
    std::vector<std::string> args = {"train",
                                     "--data",
                                     train_data().string(),
                                     "--seq-len",
                                     "16",
                                     "--global-batch",
                                     "4",
                                     "--steps",
                                     "5",
                                     "--lr",
                                     "1e-3",
                                     "--warmup",
                                     "2",
                                     "--seed",
                                     "3",
                                     "--eval-every",
                                     "0",
                                     "--log-every",
                                     "1",
                                     "--calib-sequences",
                                     "6",
                                     "--out",
                                     out.string()};
    if (model) args.insert(args.end(), {"--model", kModel.string()});
    return with(args, more);
  }

  static fs::path step(const fs::path& run, int s) {
    char name[32];
    std::snprintf(name, sizeof(name), "step-%08d", s);
    return run / "checkpoints" / name;
  }

  // Runs case `format` on `ranks` with `more` and compares with modelopt's run.
  void expect_matches_modelopt(const std::string& format, int ranks,
                               const std::vector<std::string>& more = {}) {
    const fs::path out = dir_ / (format + "-" + std::to_string(ranks) +
                                 (more.empty() ? std::string() : "-" + more.back()));
    const auto r =
        mdist(ranks, qat_args(out, with({"--quant", format, "--save-every", "0"}, more)));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_THAT(r.out, HasSubstr("mdist train: quantization-aware training, --quant " + format));

    const hf::SafetensorsFile expected(kExpected);
    const at::Tensor losses = expected.tensor(format + ".losses");
    const auto steps = metrics(out);
    ASSERT_EQ(static_cast<int64_t>(steps.size()), losses.numel());
    double worst_loss = 0;
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const double want = losses[static_cast<int64_t>(i)].item<double>();
      worst_loss =
          std::max(worst_loss, std::abs(steps[i]["loss"].get<double>() - want) / std::abs(want));
    }
    EXPECT_LE(worst_loss, 1e-5);

    // The quantizer state, mdist's per-expert names folded into modelopt's fused ones (the
    // shared quantizers must hold one amax).
    const hf::SafetensorsFile state_file(step(out, 5) / "qat_quantizers.safetensors");
    std::map<std::string, at::Tensor> saved;
    for (const auto& name : state_file.names()) saved.emplace(name, state_file.tensor(name));
    std::vector<std::string> problems;
    const auto state = quant::testing::with_fused_expert_names(saved, problems);
    EXPECT_TRUE(problems.empty()) << ::testing::PrintToString(problems);
    double worst_state = 0, worst_weight = 0;
    int states = 0, weights = 0;
    const hf::SafetensorsFile trained(step(out, 5) / "model.safetensors");
    for (const auto& key : expected.names()) {
      if (!key.starts_with(format + ".") || key.ends_with(".losses")) continue;
      const std::string name = key.substr(format.size() + 1);
      const at::Tensor want = expected.tensor(key).to(at::kDouble);
      if (key.ends_with("._amax")) {
        const auto it = state.find(name);
        if (it == state.end()) {
          ADD_FAILURE() << name << " missing from qat_quantizers.safetensors";
          continue;
        }
        const at::Tensor got = it->second.to(at::kDouble).flatten();
        ASSERT_EQ(got.numel(), want.numel()) << name;
        worst_state = std::max(
            worst_state, ((got - want.flatten()).abs() / want.flatten().abs().clamp_min(1e-30))
                             .max()
                             .item<double>());
        ++states;
        continue;
      }
      if (!trained.contains(name)) {
        ADD_FAILURE() << name << " missing from the checkpoint";
        continue;
      }
      const at::Tensor got = trained.tensor(name).to(at::kDouble);
      ASSERT_EQ(got.sizes(), want.sizes()) << name;
      worst_weight = std::max(worst_weight, (got - want).abs().max().item<double>());
      ++weights;
    }
    // 2 layers: 7 Linears' 2 quantizers, 2 shared expert inputs and 4 x 2 expert weights each.
    EXPECT_GT(states, 20);
    EXPECT_GT(weights, 30);  // every expert's gate, up and down of both layers among them
    EXPECT_LE(worst_state, 1e-5);
    EXPECT_LE(worst_weight, 1e-5);
    std::cout << "[ measured ] qat_qwen3_moe " << format << " on " << ranks << " rank(s)"
              << (more.empty() ? "" : " " + more.front() + " " + more.back()) << ": losses within "
              << worst_loss << " relative, weights within " << worst_weight
              << ", quantizer state within " << worst_state << " relative of modelopt's QAT"
              << std::endl;
  }
};

TEST_F(QatMoeCommand, OneRankMatchesModelopt) {
  expect_matches_modelopt("fp8", 1);
  expect_matches_modelopt("int8", 1);
}

// FSDP2 over 2 data-parallel ranks: every rank holds every expert (sharded); the shared expert
// input amax and each expert's weight amax synced over the ranks.
TEST_F(QatMoeCommand, TwoRanksMatchModelopt) { expect_matches_modelopt("fp8", 2); }

// --ep 2: each rank holds 2 of a block's 4 experts; the shared input amax is synced over the
// world, an expert's weight amax over the ranks holding it.
TEST_F(QatMoeCommand, ExpertParallelMatchesModelopt) {
  expect_matches_modelopt("fp8", 2, {"--ep", "2"});
  expect_matches_modelopt("int8", 2, {"--ep", "2"});
}

// A run cut after its step-2 checkpoint, resumed on another layout: the quantizers come from
// the checkpoint whole (every expert's), not from a calibration on the trained weights.
TEST_F(QatMoeCommand, ResumeOnAnyLayoutContinuesTheUninterruptedRun) {
  const std::vector<std::string> flags = {"--quant", "fp8", "--save-every", "2", "--keep", "5"};
  struct Layout {
    int ranks;
    std::vector<std::string> first, resumed;
  };
  for (const Layout& l :
       {Layout{1, {}, {}}, Layout{2, {}, {"--ep", "2"}}, Layout{2, {"--ep", "2"}, {}}}) {
    const std::string name = l.first.empty() ? "single" : "ep";
    const fs::path whole = dir_ / ("whole-" + name);
    if (!fs::exists(whole)) {
      const int ranks = l.first.empty() ? 1 : 2;
      const auto r = mdist(ranks, qat_args(whole, with(flags, l.first)));
      ASSERT_EQ(r.exit_code, 0) << describe(r);
    }
    const fs::path cut =
        dir_ / ("cut-" + name + "-" + std::to_string(l.ranks) + (l.resumed.empty() ? "" : "-ep"));
    SCOPED_TRACE(cut.filename().string());
    fs::copy(whole, cut, fs::copy_options::recursive);
    fs::remove_all(step(cut, 4));
    fs::remove_all(step(cut, 5));
    std::ofstream(cut / "checkpoints" / "latest") << "step-00000002\n";
    const auto r = mdist(l.ranks, qat_args(cut, with(with(flags, {"--resume"}), l.resumed), false));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_THAT(r.out, HasSubstr("the quantizers of " + step(cut, 2).string()));
    const auto expected = metrics(whole), resumed = metrics(cut);
    ASSERT_EQ(resumed.size(), expected.size());
    double worst_loss = 0;
    for (std::size_t i = 0; i < expected.size(); ++i) {
      const double want = expected[i]["loss"].get<double>();
      worst_loss =
          std::max(worst_loss, std::abs(resumed[i]["loss"].get<double>() - want) / std::abs(want));
    }
    EXPECT_LE(worst_loss, 1e-6);
    const hf::SafetensorsFile a(step(whole, 5) / "model.safetensors");
    const hf::SafetensorsFile b(step(cut, 5) / "model.safetensors");
    ASSERT_EQ(a.names(), b.names());
    double worst = 0;
    for (const auto& n : a.names()) {
      worst = std::max(worst, (a.tensor(n) - b.tensor(n)).abs().max().item<double>());
    }
    EXPECT_LE(worst, 1e-6);
    std::cout << "[ measured ] fp8 MoE QAT " << name << " resumed at step 2 on " << l.ranks
              << " rank(s)" << (l.resumed.empty() ? "" : " --ep 2") << ": losses within "
              << worst_loss << " relative, weights within " << worst << " of the uninterrupted run"
              << std::endl;
  }
}

// The export of the trained model with the quantizers as calibrated before step 1.
TEST_F(QatMoeCommand, ExportEqualsFromRunOnEveryLayout) {
  const auto bytes_equal = [&](const fs::path& a, const fs::path& b) {
    for (const std::string f : {"model.safetensors", "config.json", "hf_quant_config.json"}) {
      EXPECT_EQ(read(a / f), read(b / f)) << a / f << " vs " << b / f;
    }
  };
  const fs::path run = dir_ / "run", exported = dir_ / "exported";
  {
    const auto r = mdist(1, qat_args(run, {"--quant", "fp8", "--save-every", "0",
                                           "--export-quantized", exported.string()}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
  }
  ASSERT_TRUE(fs::exists(exported / "model.safetensors"));
  const fs::path from_run = dir_ / "from-run";
  {
    const auto r =
        mdist(1, with({"quantize", "--from-run", run.string(), "--out", from_run.string()}, {}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
  }
  bytes_equal(exported, from_run);
  // Every expert split as modelopt's export does, each with its own weight scale.
  const hf::SafetensorsFile file(exported / "model.safetensors");
  EXPECT_TRUE(file.contains("model.layers.1.mlp.experts.3.up_proj.weight_scale"));
  EXPECT_EQ(file.tensor("model.layers.0.mlp.experts.2.down_proj.weight").scalar_type(),
            at::kFloat8_e4m3fn);

  const fs::path ep_run = dir_ / "ep-run", ep_exported = dir_ / "ep-exported";
  {
    const auto r = mdist(2, qat_args(ep_run, {"--quant", "fp8", "--save-every", "0", "--ep", "2",
                                              "--export-quantized", ep_exported.string()}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
  }
  // Under --ep the trained weights are one process's within rounding, not bit-equal (the
  // experts' matrix products run on other row counts), so the --ep export is compared with
  // `mdist quantize --from-run` of the same --ep run.
  const fs::path ep_from_run = dir_ / "ep-from-run";
  {
    const auto r = mdist(
        1, with({"quantize", "--from-run", ep_run.string(), "--out", ep_from_run.string()}, {}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
  }
  bytes_equal(ep_exported, ep_from_run);
}

TEST_F(QatMoeCommand, BadInputIsOneLineAndWritesNothing) {
  const fs::path out = dir_ / "out";
  struct Case {
    std::vector<std::string> more;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--quant", "nvfp4"},
       "--quant nvfp4 on a mixture of experts: quantization-aware training of a mixture of "
       "experts takes fp8 or int8 only yet"},
      {{"--quant", "int4_awq"}, "--quant int4_awq on a mixture of experts"},
      {{"--quant", "fp8", "--kv-cache", "fp8"},
       "--quant fp8 on a mixture of experts with --kv-cache: not supported together yet"},
      {{"--quant", "int8", "--param-dtype", "bf16"},
       "--quant int8 on a mixture of experts with --param-dtype: not supported together yet"},
      {{"--quant", "fp8", "--teacher", kModel.string()},
       "--quant fp8 on a mixture of experts with --teacher: not supported together yet"},
  };
  train_data();  // written before the tree is taken
  const auto before = tree(dir_);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message);
    const auto r = mdist(1, qat_args(out, c.more));
    EXPECT_EQ(r.exit_code, 2) << describe(r);
    EXPECT_THAT(r.err, HasSubstr("[rank0]: mdist train: error: ")) << describe(r);
    EXPECT_THAT(r.err, HasSubstr(c.message)) << describe(r);
    EXPECT_EQ(error_lines(r.err), 1) << r.err;
    EXPECT_EQ(tree(dir_), before);
  }
  // mdist's own fp8 export of this model (make_ptq_moe_fixtures.py's modelopt export) as --model.
  // (without --calib-sequences, which an export as --model refuses first)
  const auto r = mdist(1, {"train", "--model", (kModel / "export_fp8").string(), "--data",
                           train_data().string(), "--seq-len", "16", "--global-batch", "4",
                           "--steps", "5", "--quant", "fp8", "--out", out.string()});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("is a quantized export of a mixture of experts")) << describe(r);
  EXPECT_EQ(error_lines(r.err), 1) << r.err;
  EXPECT_EQ(tree(dir_), before);
}

}  // namespace
}  // namespace mdist::testing
