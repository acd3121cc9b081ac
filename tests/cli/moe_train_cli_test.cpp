// `mdist train --ep E` end to end (real processes through mdistrun): the losses of every
// expert-parallel layout are one process's, checkpoints written under one (dp, ep) layout
// resume under another as the uninterrupted run, and --ep that does not fit is one line.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
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

class MdistMoeTrain : public MdistCommand {
 protected:
  // Each step's `key` ("loss", "grad_norm") in metrics.jsonl.
  static std::vector<double> losses(const fs::path& run, const char* key = "loss") {
    std::vector<double> out;
    for (const auto& line : metrics(run)) out.push_back(line[key].get<double>());
    return out;
  }

  // The largest |a - b| over two runs' losses, relative to a.
  static double loss_gap(const std::vector<double>& a, const std::vector<double>& b) {
    EXPECT_EQ(a.size(), b.size());
    double gap = 0;
    for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      gap = std::max(gap, std::abs(a[i] - b[i]) / std::abs(a[i]));
    }
    return gap;
  }

  // The largest |a - b| over every tensor of two saved models, which must hold the same
  // tensors (every expert of both), and the tensor where it is.
  struct Gap {
    double value = 0;
    std::string where;
  };
  static Gap weight_gap(const fs::path& a, const fs::path& b) {
    const mdist::hf::SafetensorsCheckpoint x(a), y(b);
    EXPECT_EQ(x.names(), y.names()) << a << " vs " << b;
    Gap gap;
    for (const auto& name : x.names()) {
      if (!y.contains(name)) continue;
      const double d = (x.tensor(name).to(at::kDouble) - y.tensor(name).to(at::kDouble))
                           .abs()
                           .max()
                           .item<double>();
      if (d > gap.value) gap = {d, name};
    }
    return gap;
  }

  static fs::path step_dir(const fs::path& run, int step) {
    char name[32];
    std::snprintf(name, sizeof(name), "step-%08d", step);
    return run / "checkpoints" / name;
  }
};

// 10 steps on 4 ranks as (dp, ep) = (4, 1), (4, 2), (4, 4) give one process's losses (1e-5;
// the load-balancing loss off: it is computed per rank, as transformers does under DDP, so
// with it 4 ranks train a slightly different objective than 1); with it on, every ep gives
// (4, 1)'s losses. The final checkpoints hold every expert, as the single process's, with its
// values.
TEST_F(MdistMoeTrain, EveryExpertParallelLayoutTrainsAsOneProcess) {
  const auto model = qwen3_moe_model("moe", 8, 0.0);
  const auto balanced = qwen3_moe_model("balanced", 8, 0.01);
  const auto train = [&](const fs::path& with_model, int ranks, int ep, const std::string& name) {
    const auto out = dir_ / name;
    const RunResult r =
        mdist(ranks, train_args({"--model", with_model.string(), "--steps", "10", "--ep",
                                 std::to_string(ep), "--out", out.string()}));
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    if (ep > 1) {
      EXPECT_THAT(r.out, HasSubstr("experts over ep " + std::to_string(ep) + " x edp " +
                                   std::to_string(4 / ep)));
    }
    EXPECT_EQ(metrics(out).size(), 10u) << name;
    return out;
  };
  const auto single = train(model, 1, 1, "np1");
  const auto reference = losses(single);
  ASSERT_EQ(reference.size(), 10u);
  const auto balanced_dp = losses(train(balanced, 4, 1, "balanced-ep1"));
  for (const int ep : {1, 2, 4}) {
    const std::string ep_text = std::to_string(ep);
    const auto run = train(model, 4, ep, "ep" + ep_text);
    const double gap = loss_gap(reference, losses(run));
    EXPECT_LT(gap, 1e-5) << "ep " << ep;
    // The clipped global gradient norm counts every expert once.
    const double norm_gap = loss_gap(losses(single, "grad_norm"), losses(run, "grad_norm"));
    EXPECT_LT(norm_gap, 1e-5) << "ep " << ep;
    const Gap weights = weight_gap(step_dir(single, 10), step_dir(run, 10));
    // The embedding's rows of tokens seen once or twice get gradients of rounding-noise size
    // in some coordinates, which AdamW's normalised first steps turn into differences up to
    // ~4e-5 (measured: 3.9e-5 with ep 1, i.e. plain data parallelism, 1.3e-5 with ep 2, 2.4e-7
    // with ep 4; every other tensor closer). A missing or misplaced expert is off by ~1e-2.
    EXPECT_LT(weights.value, 2e-4) << "ep " << ep << ": " << weights.where;
    std::cout << "ep " << ep << ": losses within " << gap << " (relative) of 1 rank's, "
              << "gradient norms within " << norm_gap << ", final "
              << "weights within " << weights.value << " (" << weights.where << ")" << std::endl;
    if (ep > 1) {
      const double balanced_gap =
          loss_gap(balanced_dp, losses(train(balanced, 4, ep, "balanced-ep" + ep_text)));
      EXPECT_LT(balanced_gap, 1e-6) << "ep " << ep << " with the load-balancing loss";
      std::cout << "ep " << ep << " with the load-balancing loss: losses within " << balanced_gap
                << " of ep 1's" << std::endl;
    }
  }
  // The model learns.
  EXPECT_LT(reference.back(), reference.front() - 0.3);
}

// A run on (dp, ep) = (4, 2) checkpointed at step 5 resumes on (4, 4), on (2, 1) and on one
// process to step 10 as the uninterrupted run: the same losses and final weights.
TEST_F(MdistMoeTrain, ResumesAcrossExpertParallelLayouts) {
  const auto model = qwen3_moe_model("moe", 8, 0.0);
  const auto whole = dir_ / "whole";
  const auto args = train_args({"--steps", "10", "--save-every", "5", "--keep", "5"});
  RunResult r =
      mdist(4, with(args, {"--model", model.string(), "--ep", "2", "--out", whole.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto expected = losses(whole);
  ASSERT_EQ(expected.size(), 10u);
  const struct {
    int ranks;
    int ep;
  } layouts[] = {{4, 4}, {2, 1}, {1, 1}};
  for (const auto& [ranks, ep] : layouts) {
    const std::string what =
        "resumed on " + std::to_string(ranks) + " ranks, ep " + std::to_string(ep);
    // The same run, stopped after its step-5 checkpoint.
    const auto cut = dir_ / ("cut-" + std::to_string(ranks) + "-" + std::to_string(ep));
    fs::copy(whole, cut, fs::copy_options::recursive);
    fs::remove_all(step_dir(cut, 10));
    std::ofstream(cut / "checkpoints" / "latest") << "step-00000005\n";
    std::vector<std::string> resume = {"--out", cut.string(), "--resume"};
    if (ep > 1) resume.insert(resume.end(), {"--ep", std::to_string(ep)});
    r = mdist(ranks, with(args, resume));
    ASSERT_EQ(r.exit_code, 0) << what << "\n" << describe(r);
    EXPECT_THAT(r.out, HasSubstr("steps 6..10 (resumed from")) << what;
    const auto resumed = losses(cut);
    ASSERT_EQ(resumed.size(), 10u) << what;
    const double gap = loss_gap(expected, resumed);
    const Gap weights = weight_gap(step_dir(whole, 10), step_dir(cut, 10));
    // Measured: (4, 4) bit for bit; (2, 1) and 1 rank sum the gradients of 4 sequences in
    // another order, ~1e-7 relative in the losses and ~1e-8 in the weights.
    EXPECT_LT(gap, 1e-6) << what;
    EXPECT_LT(weights.value, 1e-6) << what << ": " << weights.where;
    std::cout << what << ": losses within " << gap << " (relative), final weights within "
              << weights.value << " (" << weights.where << ")" << std::endl;
  }
}

// Resume is exact where parameters miss steps: 16 experts, top-1, 4 sequences of 8 tokens a
// step, so that some experts get no token in some steps (their AdamW step count lags the
// trainer's, as in torch's AdamW) and some none before the first checkpoint (no optimizer state
// at all). Checkpointed every step on (dp, ep) = (1, 1), (2, 1), (2, 2), (4, 2), (4, 4); resumed
// from step 1 on the next layout and from step 3 on the same one: the uninterrupted losses and
// final weights (1e-6).
TEST_F(MdistMoeTrain, ResumeIsExactForExpertsThatMissSteps) {
  const auto model = qwen3_moe_model("moe16", 16, 0.0, 1);
  const auto args = train_args(
      {"--steps", "6", "--save-every", "1", "--keep", "10", "--seq-len", "8", "--eval-every", "0"});
  const struct Layout {
    int ranks;
    int ep;
  } layouts[] = {{1, 1}, {2, 1}, {2, 2}, {4, 2}, {4, 4}};
  const auto on = [&](const Layout& l, std::vector<std::string> more) {
    if (l.ep > 1) more.insert(more.end(), {"--ep", std::to_string(l.ep)});
    return mdist(l.ranks, with(args, more));
  };
  const auto name = [](const Layout& l) {
    return std::to_string(l.ranks) + "x" + std::to_string(l.ep);
  };
  // The steps each parameter's AdamW state is at in a checkpoint, and the parameters the
  // checkpoint lists as having no state yet.
  const auto optimizer_steps = [](const fs::path& checkpoint) {
    std::map<std::string, int64_t> steps;
    std::set<std::string> stateless;
    for (const auto& entry : fs::directory_iterator(checkpoint / "optimizer")) {
      const mdist::hf::SafetensorsFile file(entry.path());
      for (const auto& key : file.names()) {
        if (key.ends_with("/step")) {
          steps[key.substr(0, key.size() - 5)] = file.tensor(key).item<int64_t>();
        }
      }
      for (const auto& n : nlohmann::json::parse(file.metadata().at("no_state"))) {
        stateless.insert(n.get<std::string>());
      }
    }
    return std::pair{steps, stateless};
  };
  std::vector<fs::path> wholes;
  for (const auto& l : layouts) {
    const auto whole = dir_ / ("whole-" + name(l));
    const RunResult r = on(l, {"--model", model.string(), "--out", whole.string()});
    ASSERT_EQ(r.exit_code, 0) << name(l) << "\n" << describe(r);
    ASSERT_EQ(metrics(whole).size(), 6u) << name(l);
    wholes.push_back(whole);
  }
  // The case the test is about: experts behind the trainer at step 3, and experts without state
  // at step 1.
  const auto [at3, stateless3] = optimizer_steps(step_dir(wholes[0], 3));
  const auto [at1, stateless1] = optimizer_steps(step_dir(wholes[0], 1));
  int lagging = 0;
  for (const auto& [param, step] : at3) lagging += step < 3;
  EXPECT_GT(lagging, 0) << "no parameter missed a step: the test proves nothing";
  EXPECT_FALSE(stateless1.empty()) << "every expert had a token at step 1";
  std::cout << "at step 3: " << lagging << " parameters behind the trainer's step, "
            << stateless3.size() << " without state; at step 1: " << stateless1.size()
            << " without state" << std::endl;
  for (std::size_t i = 0; i < std::size(layouts); ++i) {
    const Layout& saved = layouts[i];
    const auto expected = losses(wholes[i]);
    for (const auto& [from, resumed_on] :
         {std::pair{1, layouts[(i + 1) % std::size(layouts)]}, std::pair{3, saved}}) {
      const std::string what = "saved on " + name(saved) + ", resumed from step " +
                               std::to_string(from) + " on " + name(resumed_on);
      const auto cut = dir_ / ("cut-" + name(saved) + "-" + std::to_string(from));
      fs::copy(wholes[i], cut, fs::copy_options::recursive);
      for (int step = from + 1; step <= 6; ++step) fs::remove_all(step_dir(cut, step));
      std::ofstream(cut / "checkpoints" / "latest")
          << step_dir(cut, from).filename().string() << "\n";
      const RunResult r = on(resumed_on, {"--out", cut.string(), "--resume"});
      ASSERT_EQ(r.exit_code, 0) << what << "\n" << describe(r);
      EXPECT_THAT(r.out, Not(HasSubstr("warning"))) << what;
      const auto resumed = losses(cut);
      ASSERT_EQ(resumed.size(), 6u) << what;
      const double gap = loss_gap(expected, resumed);
      const Gap weights = weight_gap(step_dir(wholes[i], 6), step_dir(cut, 6));
      EXPECT_LT(gap, 1e-6) << what;
      EXPECT_LT(weights.value, 1e-6) << what << ": " << weights.where;
      std::cout << what << ": losses within " << gap << ", final weights within " << weights.value
                << std::endl;
    }
  }
}

// A job whose ranks are SIGKILLed at random moments under mdistrun --max-restarts 3 with
// --resume auto and --ep 2, on the 16-expert top-1 model (experts without state in early
// checkpoints), completes with the uninterrupted losses; a kill after the last checkpoint
// (during teardown) ends in a restart that finds the run complete and exits 0.
TEST_F(MdistMoeTrain, RestartsUnderExpertParallelismLoseNoTraining) {
  const auto model = qwen3_moe_model("moe16", 16, 0.0, 1);
  const auto args = train_args({"--model", model.string(), "--steps", "48", "--save-every", "1",
                                "--seq-len", "8", "--eval-every", "0", "--ep", "2"});
  const auto whole = dir_ / "whole";
  auto r = mdist(2, with(args, {"--out", whole.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto run = dir_ / "run";
  std::vector<std::string> argv = {MDIST_LAUNCHER, "--nproc-per-node", "2", "--max-restarts", "3",
                                   MDIST_CLI};
  for (const auto& a : with(args, {"--out", run.string(), "--resume", "auto"})) argv.push_back(a);
  const pid_t launcher = spawn(argv, dir_ / "job.log");
  ASSERT_GT(launcher, 0);
  std::mt19937 random(static_cast<unsigned>(::getpid()));
  bool killed_after_last = false;
  const auto [status, kills] =
      kill_rank_while_running(launcher, 1, 3, std::chrono::seconds(200), [&](int done) {
        if (done < 2) {
          // A random moment of this attempt: start-up, a step or a checkpoint.
          std::this_thread::sleep_for(std::chrono::milliseconds(50 + random() % 400));
          return true;
        }
        // The third: as soon as the last checkpoint is in place, while the ranks tear down.
        killed_after_last = read(run / "checkpoints" / "latest") == "step-00000048\n";
        return killed_after_last;
      });
  const std::string log = read(dir_ / "job.log");
  EXPECT_GE(kills, 2) << log;
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << log;
  // Whether the kill after the last checkpoint caught rank 1 alive depends on timing: said, not
  // asserted (ResumeAutoOnAFinishedRunIsCompleteAndWritesNothing asserts that path).
  std::cout << kills << " kills (one after the last checkpoint: " << killed_after_last
            << "); a restart found the run complete: "
            << (log.find("already complete") != std::string::npos) << std::endl;
  const auto expected = losses(whole), restarted = losses(run);
  ASSERT_EQ(restarted.size(), 48u) << log;
  EXPECT_LT(loss_gap(expected, restarted), 1e-6) << log;
  const Gap weights = weight_gap(step_dir(whole, 48), step_dir(run, 48));
  EXPECT_LT(weights.value, 1e-6) << weights.where;
}

// --ep that does not fit the world, the model or its experts: one line from rank 0, exit code
// 2, nothing written.
TEST_F(MdistMoeTrain, BadExpertParallelSizesAreOneLineAndWriteNothing) {
  const auto six = qwen3_moe_model("six", 6, 0.01);
  const auto out = dir_ / "run";
  const struct {
    int ranks;
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {4,
       {"--model", six.string(), "--ep", "3"},
       "[rank0]: mdist train: error: --ep 3 does not divide the data-parallel size 4 (world 4 / "
       "tp 1)"},
      {2,
       {"--ep", "2"},
       "[rank0]: mdist train: error: --ep 2: the model (llama) has no mixture-of-experts layers "
       "to split"},
      {4,
       {"--model", six.string(), "--ep", "4"},
       "[rank0]: mdist train: error: --ep 4: num_experts 6 is not divisible by 4"},
  };
  for (const auto& c : cases) {
    const RunResult r = mdist(c.ranks, train_args(with(c.args, {"--out", out.string()})));
    EXPECT_EQ(r.exit_code, 2) << describe(r);
    EXPECT_THAT(r.err, HasSubstr(c.message)) << describe(r);
    EXPECT_THAT(r.err, Not(HasSubstr("[rank1]"))) << describe(r);
    // One line: the error and nothing else on stderr but the launcher's own lines.
    int lines = 0;
    std::istringstream err(r.err);
    for (std::string line; std::getline(err, line);) lines += line.rfind("[rank", 0) == 0;
    EXPECT_EQ(lines, 1) << describe(r);
    EXPECT_FALSE(fs::exists(out)) << c.message;
  }
}

}  // namespace
