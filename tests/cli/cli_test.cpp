// The `mdist` command end to end, through the project's launcher with real processes: the
// invariants of issue 5 (same losses on 1, 2 and 4 ranks, resume, calibrate and eval
// independent of the rank count, a killed rank) and every bad input it names.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "mdist/hf/tokenizer.h"
#include "tests/cli/mdist_command.h"
#include "tests/support/subprocess.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using mdist::testing::error_lines;
using mdist::testing::kQuickTrain;
using mdist::testing::MdistCommand;
using mdist::testing::RunResult;
using ::testing::HasSubstr;
using ::testing::Not;

TEST_F(MdistCommand, TrainGivesTheSameLossesOnOneTwoAndFourRanks) {
  std::vector<std::vector<nlohmann::json>> runs;
  for (const int ranks : {1, 2, 4}) {
    const auto out = dir_ / ("np" + std::to_string(ranks));
    const auto r =
        mdist(ranks, train_args({"--steps", "10", "--save-every", "0", "--out", out.string()}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    runs.push_back(metrics(out));
    ASSERT_EQ(runs.back().size(), 10u);
    EXPECT_TRUE(fs::exists(out / "loss.svg"));
    EXPECT_TRUE(fs::exists(out / "checkpoints" / "step-00000010" / "model.safetensors"));
  }
  for (std::size_t step = 0; step < 10; ++step) {
    const double reference = runs[0][step]["loss"];
    for (std::size_t run = 1; run < runs.size(); ++run) {
      const double loss = runs[run][step]["loss"];
      EXPECT_NEAR(loss, reference, 1e-5 * reference) << "step " << step + 1 << ", run " << run;
    }
    EXPECT_EQ(runs[0][step]["step"], step + 1);
    EXPECT_GT(runs[0][step]["tokens_per_s"].get<double>(), 0);
    EXPECT_EQ(runs[2][step]["peak_rss_mib"].size(), 4u);
  }
  // It learns: the first loss is about ln 256 (a seeded, untrained model), and it falls.
  EXPECT_NEAR(runs[0][0]["loss"].get<double>(), std::log(256.0), 0.25);
  EXPECT_LT(runs[0][9]["loss"].get<double>(), runs[0][0]["loss"].get<double>() - 0.5);
}

TEST_F(MdistCommand, ResumeReproducesTheUninterruptedRun) {
  const auto whole = dir_ / "whole";
  const auto args = train_args({"--steps", "8", "--save-every", "4", "--keep", "5"});
  auto r = mdist(2, with(args, {"--out", whole.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  // The same run, stopped after its step-4 checkpoint: drop what came after it.
  const auto cut = dir_ / "cut";
  fs::copy(whole, cut, fs::copy_options::recursive);
  fs::remove_all(cut / "checkpoints" / "step-00000008");
  {
    std::ofstream latest(cut / "checkpoints" / "latest");
    latest << "step-00000004\n";
  }
  r = mdist(2, with(args, {"--out", cut.string(), "--resume"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("resumed from"));
  const auto expected = metrics(whole), resumed = metrics(cut);
  ASSERT_EQ(resumed.size(), 8u);
  for (std::size_t i = 4; i < 8; ++i) {
    const double a = expected[i]["loss"], b = resumed[i]["loss"];
    EXPECT_NEAR(b, a, 1e-6 * a) << "step " << i + 1;
    EXPECT_EQ(expected[i]["lr"], resumed[i]["lr"]);
  }
  // A resumed run may use another number of ranks: the optimizer state is stored by rows.
  const auto four = dir_ / "four";
  fs::copy(cut, four, fs::copy_options::recursive);
  fs::remove_all(four / "checkpoints" / "step-00000008");
  {
    std::ofstream latest(four / "checkpoints" / "latest");
    latest << "step-00000004\n";
  }
  r = mdist(4, with(args, {"--out", four.string(), "--resume"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto on_four = metrics(four);
  ASSERT_EQ(on_four.size(), 8u);
  for (std::size_t i = 4; i < 8; ++i) {
    const double a = expected[i]["loss"], b = on_four[i]["loss"];
    EXPECT_NEAR(b, a, 1e-5 * a) << "step " << i + 1;
  }
}

TEST_F(MdistCommand, EvalAndCalibrateDoNotDependOnTheRankCount) {
  const auto run = dir_ / "run";
  auto r = mdist(2, train_args({"--steps", "6", "--out", run.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto model = run / "checkpoints" / "step-00000006";
  std::vector<double> perplexities;
  std::vector<std::string> calibrations;
  for (const int ranks : {1, 2, 4}) {
    const auto eval_json = dir_ / ("eval" + std::to_string(ranks) + ".json");
    r = mdist(ranks,
              {"eval", "--model", model.string(), "--seq-len", "32", "--out", eval_json.string()});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_THAT(r.out, HasSubstr("perplexity"));
    perplexities.push_back(nlohmann::json::parse(read(eval_json))["perplexity"]);

    const auto calibration = dir_ / ("calibration" + std::to_string(ranks) + ".json");
    r = mdist(ranks, {"calibrate", "--model", model.string(), "--seq-len", "32", "--max-sequences",
                      "6", "--out", calibration.string()});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    calibrations.push_back(read(calibration));
  }
  EXPECT_NEAR(perplexities[1], perplexities[0], 1e-6 * perplexities[0]);
  EXPECT_NEAR(perplexities[2], perplexities[0], 1e-6 * perplexities[0]);
  EXPECT_GT(perplexities[0], 1.0);
  EXPECT_LT(perplexities[0], 256.0);
  EXPECT_EQ(calibrations[1], calibrations[0]);
  EXPECT_EQ(calibrations[2], calibrations[0]);
  // Every Linear of the 4-layer model (7 per layer, and lm_head), each with both maxima.
  const auto json = nlohmann::json::parse(calibrations[0]);
  EXPECT_EQ(json["modules"].size(), 4u * 7u + 1u);
  const auto& q = json["modules"]["model.layers.0.self_attn.q_proj"];
  EXPECT_GT(q["input_absmax"].get<double>(), 0);
  EXPECT_GT(q["weight_absmax"].get<double>(), 0);
  EXPECT_TRUE(json["modules"].contains("lm_head"));
}

TEST_F(MdistCommand, GenerateSamplesBytesAndIsTheSameOnEveryRankCount) {
  const auto run = dir_ / "run";
  auto r = mdist(1, train_args({"--steps", "4", "--out", run.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto model = (run / "checkpoints" / "step-00000004").string();
  const std::vector<std::string> args = {
      "generate", "--model", model, "--prompt", "KING", "--max-new-tokens", "16", "--top-k", "5"};
  const auto one = mdist(1, args), two = mdist(2, args);
  ASSERT_EQ(one.exit_code, 0) << describe(one);
  ASSERT_EQ(two.exit_code, 0) << describe(two);
  const auto sample = [](std::string out) {
    for (auto at = out.find("[rank0]: "); at != std::string::npos; at = out.find("[rank0]: ")) {
      out.erase(at, 9);
    }
    const auto begin = out.find("----\n");
    const auto end = out.rfind("\n----");
    return out.substr(begin + 5, end - begin - 5);
  };
  EXPECT_EQ(sample(one.out).substr(0, 4), "KING") << one.out;
  EXPECT_GE(sample(one.out).size(), 4u + 16u);
  EXPECT_EQ(sample(two.out), sample(one.out)) << one.out << two.out;

  // A batch (--prompt and --prompts FILE, of different lengths: left-padded) continues each
  // prompt as it is continued alone, greedy and sampled (top-p), on any rank count.
  std::ofstream(dir_ / "prompts.txt") << "First Citizen:\n\nQUEEN\n";
  const std::vector<std::vector<std::string>> choices = {{"--greedy"},
                                                         {"--top-p", "0.9", "--top-k", "0"}};
  for (const auto& how : choices) {
    std::vector<std::string> batch_args = {"generate",
                                           "--model",
                                           model,
                                           "--max-new-tokens",
                                           "12",
                                           "--prompt",
                                           "KING",
                                           "--prompts",
                                           (dir_ / "prompts.txt").string()};
    batch_args.insert(batch_args.end(), how.begin(), how.end());
    const auto batch_one = mdist(1, batch_args), batch_two = mdist(2, batch_args);
    ASSERT_EQ(batch_one.exit_code, 0) << describe(batch_one);
    ASSERT_EQ(batch_two.exit_code, 0) << describe(batch_two);
    EXPECT_EQ(sample(batch_two.out), sample(batch_one.out));
    std::string alone;
    for (const std::string prompt : {"KING", "First Citizen:", "QUEEN"}) {
      std::vector<std::string> single = {"generate", "--model",  model, "--max-new-tokens",
                                         "12",       "--prompt", prompt};
      single.insert(single.end(), how.begin(), how.end());
      const auto each = mdist(1, single);
      ASSERT_EQ(each.exit_code, 0) << describe(each);
      alone += (alone.empty() ? "" : "\n----\n") + sample(each.out);
    }
    if (how.front() == "--greedy") {
      EXPECT_EQ(sample(batch_one.out), alone) << batch_one.out;
    }
    EXPECT_EQ(sample(batch_one.out).substr(0, 4), "KING");
  }
}

TEST_F(MdistCommand, TrainContinuesFromAHuggingFaceDirectory) {
  const auto first = dir_ / "first";
  auto r = mdist(2, train_args({"--steps", "6", "--out", first.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  // Its checkpoint is an ordinary HF directory; training from it starts where it ended.
  const auto model = first / "checkpoints" / "step-00000006";
  const auto second = dir_ / "second";
  r = mdist(2, train_args({"--model", model.string(), "--steps", "2", "--out", second.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("model " + model.string()));
  const double trained = metrics(first).back()["loss"], continued = metrics(second).front()["loss"];
  EXPECT_LT(continued, metrics(first).front()["loss"].get<double>() - 0.5);
  EXPECT_NEAR(continued, trained, 0.5);
}

// A fresh run into a directory holding an earlier run is refused (nothing touched); with
// --overwrite it replaces that run, but never when --model lies inside it.
TEST_F(MdistCommand, AFreshRunReplacesAnEarlierRunOnlyWithOverwrite) {
  const auto run = dir_ / "run";
  auto r = mdist(1, train_args({"--steps", "6", "--save-every", "2", "--out", run.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto before = tree(run);
  const std::string metrics_before = read(run / "metrics.jsonl");
  r = mdist(2, train_args({"--steps", "2", "--save-every", "2", "--out", run.string()}));
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("[rank0]: mdist train: error: output directory '" + run.string() +
                               "' holds an earlier run (metrics.jsonl and 2 checkpoints); pass "
                               "--resume to continue it or --overwrite to replace it"));
  EXPECT_THAT(r.err, Not(HasSubstr("[rank1]")));
  const auto inside = run / "checkpoints" / "step-00000006";
  r = mdist(1, train_args({"--steps", "2", "--out", run.string(), "--overwrite", "--model",
                           inside.string()}));
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("mdist train: error: --model '" + inside.string() + "' is inside '" +
                               run.string() +
                               "', the run --overwrite would replace; copy it elsewhere first"));
  r = mdist(1, train_args({"--steps", "2", "--out", run.string(), "--resume", "--model",
                           inside.string()}));
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err,
              HasSubstr("mdist train: error: --resume continues from the last checkpoint "
                        "of '" +
                        run.string() + "', which is the model; --model cannot be given with it"));
  EXPECT_EQ(tree(run), before);
  EXPECT_EQ(read(run / "metrics.jsonl"), metrics_before);

  r = mdist(
      1, train_args({"--steps", "2", "--save-every", "2", "--out", run.string(), "--overwrite"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  std::vector<std::string> left;
  for (const auto& entry : fs::directory_iterator(run / "checkpoints")) {
    left.push_back(entry.path().filename().string());
  }
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"latest", "step-00000002"}));
  EXPECT_EQ(read(run / "checkpoints" / "latest"), "step-00000002\n");
  EXPECT_EQ(metrics(run).size(), 2u);
}

// A mixture of experts (Qwen3-MoE: a sparse and a dense layer) in the main job: its
// load-balancing loss is reported beside the loss, and in the objective with the config's
// router_aux_loss_coef only when the config's output_router_logits is true (as transformers adds
// it); --router-aux-loss-coef overrides both ways. With the term off the run is bit for bit the
// coefficient-0 run's; with it on the first step's loss is the same (the aux term does not
// change the forward) but the router is pushed to balance: a large coef leaves a lower aux loss.
// Tensor parallelism of MoE layers is refused (one line, exit 2, nothing written).
TEST_F(MdistCommand, TrainAddsTheMoeAuxLossAsTheConfigSays) {
  const auto model_with = [&](const std::string& name, double coef, bool output_router_logits) {
    const auto config_dir = dir_ / (name + "-config");
    fs::create_directories(config_dir);
    std::ofstream(config_dir / "config.json")
        << R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
               "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "vocab_size": 256, "num_experts": 4, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "mlp_only_layers": [1], "norm_topk_prob": true,
               "output_router_logits": )"
        << (output_router_logits ? "true" : "false") << R"(, "router_aux_loss_coef": )" << coef
        << "}\n";
    const auto model = dir_ / name;
    const auto r =
        mdist::testing::run({MDIST_SAVE_FOR_TRANSFORMERS, config_dir.string(), model.string()});
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    return model;
  };
  const auto balanced = model_with("balanced", 20.0, true), free = model_with("free", 0.0, true),
             off = model_with("off", 20.0, false);
  const auto train = [&](const fs::path& model, const std::string& name,
                         std::vector<std::string> more) {
    const auto out = dir_ / name;
    const auto r = mdist(2, train_args(with({"--model", model.string(), "--steps", "12", "--lr",
                                             "3e-3", "--out", out.string()},
                                            more)));
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    return std::pair{r.out, metrics(out)};
  };
  const auto [balanced_log, with_aux] = train(balanced, "run-balanced", {});
  const auto [free_log, without] = train(free, "run-free", {});
  const auto [off_log, by_config] = train(off, "run-off", {});
  const auto [flag_on_log, flag_on] = train(off, "run-flag-on", {"--router-aux-loss-coef", "20"});
  const auto [flag_off_log, flag_off] =
      train(balanced, "run-flag-off", {"--router-aux-loss-coef", "0"});
  ASSERT_EQ(with_aux.size(), 12u);
  ASSERT_EQ(without.size(), 12u);
  ASSERT_EQ(by_config.size(), 12u);
  ASSERT_EQ(flag_on.size(), 12u);
  ASSERT_EQ(flag_off.size(), 12u);
  EXPECT_THAT(balanced_log, HasSubstr("load-balancing loss in the objective with weight 20 (the "
                                      "config's router_aux_loss_coef, output_router_logits true)"));
  EXPECT_THAT(off_log, HasSubstr("load-balancing loss not in the objective (the config's "
                                 "output_router_logits is false; --router-aux-loss-coef W adds "
                                 "it)"));
  EXPECT_THAT(flag_on_log, HasSubstr("load-balancing loss in the objective with weight 20 "
                                     "(--router-aux-loss-coef)"));
  for (const auto& line : with_aux) {
    ASSERT_TRUE(line.contains("aux_loss")) << line.dump();
    EXPECT_GT(line["aux_loss"].get<double>(), 0) << line.dump();
    EXPECT_EQ(line["router_aux_loss_coef"], 20.0);
  }
  EXPECT_NEAR(with_aux[0]["loss"].get<double>(), without[0]["loss"].get<double>(), 1e-6);
  EXPECT_NEAR(with_aux[0]["aux_loss"].get<double>(), without[0]["aux_loss"].get<double>(), 1e-6);
  EXPECT_LT(with_aux.back()["aux_loss"].get<double>(),
            without.back()["aux_loss"].get<double>() - 1e-3);
  EXPECT_NE(with_aux[1]["loss"].get<double>(), without[1]["loss"].get<double>());
  // Off by the config, or by the flag: the coefficient-0 run; on by the flag: the run with the
  // config's term on. The same weights, the same batches: equal bit for bit.
  for (std::size_t i = 0; i < 12; ++i) {
    EXPECT_EQ(by_config[i]["loss"], without[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(by_config[i]["router_aux_loss_coef"], 0.0);
    EXPECT_EQ(flag_off[i]["loss"], without[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(flag_on[i]["loss"], with_aux[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(flag_on[i]["aux_loss"], with_aux[i]["aux_loss"]) << "step " << i + 1;
  }

  const auto refused = dir_ / "refused";
  auto r = mdist(2, train_args({"--model", balanced.string(), "--tp", "2", "--steps", "2", "--out",
                                refused.string()}));
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("[rank0]: mdist train: error: --tp 2: cannot split the model over "
                               "2 tensor-parallel ranks: Qwen3MoeForCausalLM is a mixture of "
                               "experts; tensor parallelism of MoE layers is not supported yet"));
  EXPECT_THAT(r.err, Not(HasSubstr("[rank1]")));
  EXPECT_FALSE(fs::exists(refused));
  r = mdist(1, train_args({"--model", balanced.string(), "--router-aux-loss-coef", "-1", "--out",
                           refused.string()}));
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("mdist train: error: --router-aux-loss-coef (0: none)"));
  EXPECT_FALSE(fs::exists(refused));
}

// Tensor parallelism in the main job, on 4 ranks as (dp, tp) = (4, 1), (2, 2) and (1, 4): the
// same losses; a (2, 2) checkpoint resumes on (4, 1) and (1, 4) with the uninterrupted run's
// losses; eval, calibrate and generate of one checkpoint agree across the layouts.
TEST_F(MdistCommand, TensorParallelLayoutsTrainResumeEvalCalibrateAndGenerateAlike) {
  const auto args = train_args({"--steps", "6", "--save-every", "3", "--keep", "5"});
  std::map<int, std::vector<nlohmann::json>> runs;
  for (const int tp : {1, 2, 4}) {
    const auto out = dir_ / ("tp" + std::to_string(tp));
    const auto r = mdist(4, with(args, {"--tp", std::to_string(tp), "--out", out.string()}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_THAT(r.out, HasSubstr("4 rank(s) as dp " + std::to_string(4 / tp) + " x tp " +
                                 std::to_string(tp)));
    runs[tp] = metrics(out);
    ASSERT_EQ(runs[tp].size(), 6u);
  }
  for (std::size_t i = 0; i < 6; ++i) {
    const double reference = runs[1][i]["loss"];
    for (const int tp : {2, 4}) {
      EXPECT_NEAR(runs[tp][i]["loss"].get<double>(), reference, 1e-5 * reference)
          << "tp " << tp << " step " << i + 1;
    }
  }
  // Resume the (2, 2) run from step 3 on the other layouts.
  for (const int tp : {1, 4}) {
    const auto cut = dir_ / ("resume-on-tp" + std::to_string(tp));
    fs::copy(dir_ / "tp2", cut, fs::copy_options::recursive);
    fs::remove_all(cut / "checkpoints" / "step-00000006");
    std::ofstream(cut / "checkpoints" / "latest") << "step-00000003\n";
    const auto r =
        mdist(4, with(args, {"--tp", std::to_string(tp), "--out", cut.string(), "--resume"}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    const auto resumed = metrics(cut);
    ASSERT_EQ(resumed.size(), 6u);
    for (std::size_t i = 3; i < 6; ++i) {
      const double a = runs[2][i]["loss"], b = resumed[i]["loss"];
      EXPECT_NEAR(b, a, 1e-5 * a) << "resumed on tp " << tp << ", step " << i + 1;
    }
  }
  const auto model = (dir_ / "tp1" / "checkpoints" / "step-00000006").string();
  std::vector<double> perplexities;
  std::vector<nlohmann::json> calibrations;
  std::vector<std::string> samples;
  for (const int tp : {1, 2, 4}) {
    const std::string t = std::to_string(tp);
    const auto eval_json = dir_ / ("eval-tp" + t + ".json");
    auto r = mdist(
        4, {"eval", "--model", model, "--seq-len", "32", "--tp", t, "--out", eval_json.string()});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    perplexities.push_back(nlohmann::json::parse(read(eval_json))["perplexity"]);
    const auto calibration = dir_ / ("calibration-tp" + t + ".json");
    r = mdist(4, {"calibrate", "--model", model, "--seq-len", "32", "--max-sequences", "6", "--tp",
                  t, "--out", calibration.string()});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    calibrations.push_back(nlohmann::json::parse(read(calibration))["modules"]);
    r = mdist(4, {"generate", "--model", model, "--greedy", "--max-new-tokens", "24", "--tp", t});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    samples.push_back(r.out.substr(r.out.find("----")));
  }
  for (std::size_t i = 1; i < 3; ++i) {
    EXPECT_NEAR(perplexities[i], perplexities[0], 1e-6 * perplexities[0]);
    EXPECT_EQ(samples[i], samples[0]);
    // The same modules; the weights' maxima exactly (the max of the parts is the max of the
    // whole), the inputs' within 1e-6 relative (activations after a tensor-parallel
    // all-reduce are summed in another order).
    ASSERT_EQ(calibrations[i].size(), calibrations[0].size());
    for (const auto& [name, stats] : calibrations[0].items()) {
      ASSERT_TRUE(calibrations[i].contains(name)) << name;
      EXPECT_EQ(calibrations[i][name]["weight_absmax"], stats["weight_absmax"]) << name;
      const double a = stats["input_absmax"], b = calibrations[i][name]["input_absmax"];
      EXPECT_NEAR(b, a, 1e-6 * a) << name;
    }
  }
}

TEST_F(MdistCommand, InfoShowsVersionsBackendsRanksAndGroups) {
  const auto r = mdist(2, {"info"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("libtorch 2.15.0"));
  EXPECT_THAT(r.out, HasSubstr("backends: gloo (CPU) yes"));
  EXPECT_THAT(r.out, HasSubstr("job: 2 rank(s), backend gloo"));
  EXPECT_THAT(r.out, HasSubstr("rank 1: local rank 1 of 2"));
  EXPECT_THAT(r.out, HasSubstr("ParallelState(data_parallel_group="));
  const auto split = mdist(4, {"info", "--tp", "2"});
  ASSERT_EQ(split.exit_code, 0) << describe(split);
  EXPECT_THAT(split.out, HasSubstr("layout: 4 rank(s) as dp 2 x tp 2"));
  EXPECT_THAT(split.out, HasSubstr("tensor-parallel groups: [0,1] [2,3]"));
  EXPECT_THAT(split.out, HasSubstr("data-parallel groups: [0,2] [1,3]"));
}

TEST_F(MdistCommand, HelpOnEverySubcommand) {
  for (const std::string command : {"train", "eval", "calibrate", "quantize", "generate", "info"}) {
    const auto r = mdist::testing::run({MDIST_CLI, command, "--help"});
    EXPECT_EQ(r.exit_code, 0) << command;
    EXPECT_THAT(r.out, HasSubstr("Usage: mdist " + command)) << r.out;
  }
  const auto top = mdist::testing::run({MDIST_CLI, "--help"});
  EXPECT_EQ(top.exit_code, 0);
  for (const char* command :
       {"train", "eval", "calibrate", "quantize", "generate", "tokenize", "info"}) {
    EXPECT_THAT(top.out, HasSubstr(command));
  }
  EXPECT_THAT(mdist::testing::run({MDIST_CLI, "train", "--help"}).out, HasSubstr("--global-batch"));
  const auto none = mdist::testing::run({MDIST_CLI});
  EXPECT_NE(none.exit_code, 0);
}

// --- Bad input: one line naming the problem, a non-zero exit, no output files. -------------

struct BadInput {
  std::string name;
  int ranks;
  std::vector<std::string> args;  // OUT, DIR in them are replaced
  std::string message;
};

// Test names show the case's name, not the struct's bytes.
void PrintTo(const BadInput& bad, std::ostream* os) { *os << bad.name; }

class MdistBadInput : public MdistCommand, public ::testing::WithParamInterface<BadInput> {};

TEST_P(MdistBadInput, IsOneClearLineAndNoOutput) {
  const BadInput& bad = GetParam();
  // Fixtures the cases refer to.
  fs::create_directories(dir_ / "no_config");
  fs::create_directories(dir_ / "gpt2");
  std::ofstream(dir_ / "gpt2" / "config.json") << R"({"architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 256})";
  std::ofstream(dir_ / "short.txt") << "too short";
  std::ofstream(dir_ / "big_id.ids") << "1 2 3 256 4";
  std::ofstream(dir_ / "a_file") << "not a directory";
  std::ofstream(dir_ / "empty.txt") << "\n\n";  // blank lines only: no prompt
  fs::create_directories(dir_ / "heads3");
  std::ofstream(dir_ / "heads3" / "config.json") << R"({"architectures": ["LlamaForCausalLM"],
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 3, "num_key_value_heads": 3, "vocab_size": 256})";
  std::vector<std::string> args;
  for (std::string arg : bad.args) {
    for (const auto& [key, value] : {std::pair<std::string, std::string>{"DIR", dir_.string()},
                                     {"OUT", (dir_ / "out").string()}}) {
      if (const auto at = arg.find(key); at != std::string::npos)
        arg.replace(at, key.size(), value);
    }
    args.push_back(arg);
  }
  const auto r = mdist(bad.ranks, args);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  std::string message = bad.message;
  for (auto at = message.find("DIR"); at != std::string::npos; at = message.find("DIR")) {
    message.replace(at, 3, dir_.string());
  }
  EXPECT_THAT(r.err, HasSubstr("[rank0]: mdist " + args[0] + ": error: " + message)) << r.err;
  // One line from the job (the launcher adds its own summary of which rank failed).
  EXPECT_EQ(error_lines(r.err), 1) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "out")) << "partial output left behind";
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MdistBadInput,
    ::testing::Values(
        BadInput{"MissingModelDir",
                 2,
                 {"train", "--model", "DIR/missing", "--out", "OUT"},
                 "model directory 'DIR/missing' does not exist"},
        BadInput{"ModelDirWithoutConfig",
                 2,
                 {"train", "--model", "DIR/no_config", "--out", "OUT"},
                 "model directory 'DIR/no_config' has no config.json"},
        BadInput{"ModelDirIsAFile",
                 1,
                 {"eval", "--model", "DIR/a_file", "--out", "OUT"},
                 "model directory 'DIR/a_file' is not a directory"},
        BadInput{"UnsupportedArchitecture",
                 2,
                 {"train", "--model", "DIR/gpt2", "--out", "OUT"},
                 "model directory 'DIR/gpt2': "},
        BadInput{"DataShorterThanOneSequence",
                 2,
                 {"train", "--data", "DIR/short.txt", "--out", "OUT"},
                 "train: data DIR/short.txt (text, all split: 9 tokens) is shorter than one "
                 "sequence of 128 tokens (--seq-len)"},
        BadInput{"TokenIdOutsideTheVocabulary",
                 2,
                 {"train", "--data", "DIR/big_id.ids", "--out", "OUT"},
                 "data file 'DIR/big_id.ids': token 3 has id 256, outside the model's vocabulary "
                 "[0, 256)"},
        BadInput{"ParamDtypeFp16",
                 2,
                 {"train", "--param-dtype", "fp16", "--out", "OUT"},
                 "--param-dtype fp16 needs loss scaling, which mdist train does not do; use bf16"},
        BadInput{"ParamDtypeUnknown",
                 1,
                 {"train", "--param-dtype", "int8", "--out", "OUT"},
                 "--param-dtype must be bf16 or fp32 (or left out: compute in the weights' "
                 "dtype), got 'int8'"},
        BadInput{"UnwritableOutputDirectory",
                 2,
                 {"train", "--out", "DIR/a_file/run"},
                 "output directory 'DIR/a_file/run' is not writable: 'DIR/a_file' is not a "
                 "directory"},
        BadInput{"SequenceLongerThanTheModelAllows",
                 1,
                 {"eval", "--seq-len", "512"},
                 "--seq-len 512 exceeds the model's max_position_embeddings 256"},
        BadInput{"BatchNotDivisibleByDataParallelSize",
                 2,
                 {"train", "--global-batch", "3", "--out", "OUT"},
                 "--global-batch 3 is not divisible by the data-parallel size 2"},
        BadInput{"MicroBatchZero",
                 1,
                 {"train", "--micro-batch", "0", "--out", "OUT"},
                 "--micro-batch must be at least 1, got 0"},
        BadInput{"MicroBatchNotDividingThePerRankBatch",
                 2,
                 {"train", "--global-batch", "8", "--micro-batch", "3", "--out", "OUT"},
                 "--micro-batch 3 does not divide the per-rank batch: --global-batch 8 over 2 "
                 "data-parallel rank(s) is 4 sequences per rank"},
        BadInput{
            "MicroBatchNotDividingThePerRankBatchUnderTensorParallel",
            4,
            {"train", "--tp", "2", "--global-batch", "4", "--micro-batch", "4", "--out", "OUT"},
            "--micro-batch 4 does not divide the per-rank batch: --global-batch 4 over 2 "
            "data-parallel rank(s) is 2 sequences per rank"},
        BadInput{"TensorParallelSizeNotDividingTheWorld",
                 4,
                 {"train", "--tp", "3", "--out", "OUT"},
                 "--tp 3 does not divide the world size 4"},
        BadInput{"TensorParallelSizeZero",
                 2,
                 {"eval", "--tp", "0", "--out", "OUT"},
                 "--tp must be at least 1, got 0"},
        BadInput{"TensorParallelSplitOfTheHeadsImpossible",
                 3,
                 {"train", "--tp", "3", "--out", "OUT"},
                 "--tp 3: cannot split the model over 3 tensor-parallel ranks: "
                 "num_attention_heads 4 does not divide by 3"},
        BadInput{"TensorParallelCalibrateOnTooFewRanks",
                 2,
                 {"calibrate", "--tp", "4", "--out", "OUT"},
                 "--tp 4 does not divide the world size 2"},
        BadInput{"TensorParallelGenerateOnTooFewRanks",
                 2,
                 {"generate", "--tp", "4"},
                 "--tp 4 does not divide the world size 2"},
        BadInput{"BatchNotDivisibleByDataParallelSizeUnderTensorParallel",
                 4,
                 {"train", "--tp", "2", "--global-batch", "3", "--out", "OUT"},
                 "--global-batch 3 is not divisible by the data-parallel size 2"},
        BadInput{"HiddenSizeNotAMultipleOfTheHeads",
                 2,
                 {"train", "--model", "DIR/heads3", "--out", "OUT"},
                 "model directory 'DIR/heads3': mdist::hf::LlamaConfig: the hidden size (128) is "
                 "not a multiple of the number of attention heads (3)"},
        BadInput{"NegativeGradClip",
                 2,
                 {"train", "--grad-clip", "-1", "--out", "OUT"},
                 "--grad-clip (0: no clipping) must be a finite number >= 0, got -1"},
        BadInput{"MinLrRatioAboveOne",
                 2,
                 {"train", "--min-lr-ratio", "5", "--out", "OUT"},
                 "--min-lr-ratio must be in [0, 1] (the end of the cosine decay as a fraction of "
                 "--lr), got 5"},
        BadInput{"NegativeWeightDecay",
                 1,
                 {"train", "--weight-decay", "-0.1", "--out", "OUT"},
                 "--weight-decay must be a finite number >= 0, got -0.1"},
        BadInput{"NegativeSaveEvery",
                 1,
                 {"train", "--save-every", "-1", "--out", "OUT"},
                 "--save-every must be at least 0, got -1"},
        BadInput{"NanLearningRate",
                 2,
                 {"train", "--lr", "nan", "--out", "OUT"},
                 "--lr must be a positive number, got nan"},
        BadInput{"InfiniteWeightDecay",
                 1,
                 {"train", "--weight-decay", "inf", "--out", "OUT"},
                 "--weight-decay must be a finite number >= 0, got inf"},
        BadInput{"KeepZero",
                 1,
                 {"train", "--keep", "0", "--out", "OUT"},
                 "--keep must be at least 1, got 0"},
        BadInput{"NegativeEvalEvery",
                 1,
                 {"train", "--eval-every", "-1", "--out", "OUT"},
                 "--eval-every must be at least 0, got -1"},
        BadInput{"EvalEveryWithoutHeldOutData",
                 2,
                 {"train", "--eval-every", "2", "--split", "all", "--out", "OUT"},
                 "--eval-every needs held-out data: --eval-data FILE, or --split train"},
        BadInput{"ZeroTimeout",
                 2,
                 {"train", "--timeout", "0", "--out", "OUT"},
                 "--timeout must be a positive number of seconds, got 0"},
        BadInput{"InfiniteTemperature",
                 2,
                 {"generate", "--temperature", "inf"},
                 "--temperature must be a positive number (or use --greedy), got inf"},
        BadInput{"ZeroTemperature",
                 1,
                 {"generate", "--temperature", "0"},
                 "--temperature must be a positive number (or use --greedy), got 0"},
        BadInput{"TopPOutsideZeroToOne",
                 2,
                 {"generate", "--top-p", "1.5"},
                 "--top-p must be in (0, 1], got 1.5"},
        BadInput{"NegativeTopK", 1, {"generate", "--top-k", "-1"}, "--top-k must not be negative"},
        BadInput{"EmptyPromptFile",
                 2,
                 {"generate", "--prompts", "DIR/empty.txt"},
                 "--prompts: 'DIR/empty.txt' has no prompt"},
        BadInput{"PromptAndNewTokensPastTheModelsPositions",
                 2,
                 {"generate", "--prompt", "KING", "--prompts", "DIR/short.txt", "--max-new-tokens",
                  "250"},
                 "prompt 2 (9 tokens) and --max-new-tokens 250 exceed the model's "
                 "max_position_embeddings 256"},
        BadInput{"NegativeMaxSequences",
                 1,
                 {"calibrate", "--max-sequences", "-1", "--out", "OUT"},
                 "--max-sequences must be at least 0, got -1"},
        BadInput{"UnwritableCalibrationFile",
                 1,
                 {"calibrate", "--out", "DIR/a_file/calibration.json"},
                 "output file 'DIR/a_file/calibration.json' is not writable: 'DIR/a_file' is not a "
                 "directory"}),
    [](const auto& test) { return test.param.name; });

// Killing a rank mid-training ends the whole job with a non-zero code, and the last complete
// checkpoint still loads.
TEST_F(MdistCommand, KilledRankEndsTheJobAndLeavesTheLastCheckpointLoadable) {
  const auto run = dir_ / "run";
  std::vector<std::string> argv = {MDIST_LAUNCHER, "--nproc-per-node", "2", MDIST_CLI, "train"};
  for (const auto& a :
       with(kQuickTrain, {"--steps", "100000", "--save-every", "2", "--out", run.string()})) {
    argv.push_back(a);
  }
  const pid_t launcher = spawn(argv, dir_ / "job.log");
  ASSERT_GT(launcher, 0);

  // Wait for the second checkpoint, then SIGKILL rank 1 (the launcher's child with RANK=1).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(180);
  while (!fs::exists(run / "checkpoints" / "step-00000004" / "trainer_state.json") &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const pid_t victim = rank_process(launcher, 1);
  ASSERT_GT(victim, 0) << read(dir_ / "job.log");
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(launcher, &status, 0), launcher);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 0) << read(dir_ / "job.log");

  // `latest` names a complete checkpoint that loads and evaluates.
  std::ifstream latest_file(run / "checkpoints" / "latest");
  std::string latest;
  std::getline(latest_file, latest);
  ASSERT_FALSE(latest.empty());
  const auto checkpoint = run / "checkpoints" / latest;
  const auto r = mdist(1, {"eval", "--model", checkpoint.string(), "--seq-len", "32"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("perplexity"));
  // And the run resumes from it.
  const auto resumed =
      mdist(2, train_args({"--steps", std::to_string(std::stoi(latest.substr(5)) + 2),
                           "--save-every", "2", "--out", run.string(), "--resume"}));
  EXPECT_EQ(resumed.exit_code, 0) << describe(resumed);
}

// --- Issue 13: no silent wrong result. ------------------------------------------------------

// A safetensors file edited in place by the tests (the format: an 8-byte little-endian header
// length, the JSON header, the data), without libtorch.
class SafetensorsEdit {
 public:
  explicit SafetensorsEdit(const fs::path& path) {
    const std::string raw = MdistCommand_read(path);
    std::uint64_t n = 0;
    std::memcpy(&n, raw.data(), 8);
    const auto header = nlohmann::json::parse(raw.substr(8, n));
    const std::string data = raw.substr(8 + n);
    for (const auto& [name, info] : header.items()) {
      if (name == "__metadata__") {
        metadata_ = info;
        continue;
      }
      const auto begin = info["data_offsets"][0].get<std::size_t>();
      const auto end = info["data_offsets"][1].get<std::size_t>();
      tensors_[name] = {info["dtype"], info["shape"].get<std::vector<std::int64_t>>(),
                        data.substr(begin, end - begin)};
    }
  }
  struct Tensor {
    std::string dtype;
    std::vector<std::int64_t> shape;
    std::string bytes;
  };
  Tensor& operator[](const std::string& name) { return tensors_.at(name); }
  std::map<std::string, Tensor>& tensors() { return tensors_; }
  void erase(const std::string& name) { tensors_.erase(name); }
  nlohmann::json& metadata() { return metadata_; }
  std::vector<float> floats(const std::string& name) const {
    const auto& t = tensors_.at(name);
    std::vector<float> values(t.bytes.size() / 4);
    std::memcpy(values.data(), t.bytes.data(), t.bytes.size());
    return values;
  }
  void write(const fs::path& path) const {
    nlohmann::json header = nlohmann::json::object();
    if (!metadata_.is_null()) header["__metadata__"] = metadata_;
    std::string data;
    for (const auto& [name, t] : tensors_) {
      header[name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
      data += t.bytes;
    }
    std::string text = header.dump();
    while (text.size() % 8 != 0) text.push_back(' ');
    const std::uint64_t n = text.size();
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << text << data;
  }

 private:
  static std::string MdistCommand_read(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
  }
  nlohmann::json metadata_;
  std::map<std::string, Tensor> tensors_;
};

std::string repeat_bytes(const std::string& pattern, std::size_t times) {
  std::string bytes;
  for (std::size_t i = 0; i < times; ++i) bytes += pattern;
  return bytes;
}

class MdistChecks : public MdistCommand {
 protected:
  // A one-step checkpoint of the default model (config + model.safetensors), copied to `name`.
  fs::path checkpoint(const std::string& name) {
    const auto base = dir_ / "base";
    if (!fs::exists(base)) {
      const auto r = mdist(1, train_args({"--steps", "1", "--out", (dir_ / "base-run").string()}));
      EXPECT_EQ(r.exit_code, 0) << describe(r);
      fs::create_directories(base);
      for (const char* file : {"config.json", "model.safetensors"}) {
        fs::copy(dir_ / "base-run" / "checkpoints" / "step-00000001" / file, base / file);
      }
    }
    const auto copy = dir_ / name;
    fs::remove_all(copy);
    fs::copy(base, copy, fs::copy_options::recursive);
    return copy;
  }

  // Exit code 2, the exact line once from rank 0, and no `out` created.
  void expect_refused(const RunResult& r, const std::string& command, const std::string& message,
                      const fs::path& out) {
    EXPECT_EQ(r.exit_code, 2) << describe(r);
    EXPECT_THAT(r.err, HasSubstr("[rank0]: mdist " + command + ": error: " + message)) << r.err;
    EXPECT_EQ(error_lines(r.err), 1) << r.err;
    EXPECT_FALSE(fs::exists(out)) << "output left behind: " << out;
  }
};

// Tensors larger or otherwise shaped than the config wants, or of a dtype that does not
// convert, are refused as transformers refuses them, with the full shapes, on every load path
// of the main job (data parallel, tensor parallel, train and eval), and nothing is written.
TEST_F(MdistChecks, CheckpointTensorsThatDoNotFitTheConfigAreRefused) {
  struct Case {
    std::string name, key, dtype;
    std::vector<std::int64_t> shape;
    std::string message;
  };
  const std::string norm = "model.layers.0.input_layernorm.weight";
  const std::vector<Case> cases = {
      {"embed-rows",
       "model.embed_tokens.weight",
       "F32",
       {1000, 128},
       "size mismatch for 'model.embed_tokens.weight': copying a param with shape [1000, 128] "
       "from checkpoint, the shape in current model is [256, 128]"},
      {"q-rows",
       "model.layers.0.self_attn.q_proj.weight",
       "F32",
       {256, 128},
       "size mismatch for 'model.layers.0.self_attn.q_proj.weight': copying a param with shape "
       "[256, 128] from checkpoint, the shape in current model is [128, 128]"},
      {"norm-long",
       norm,
       "F32",
       {256},
       "size mismatch for '" + norm +
           "': copying a param with shape [256] from checkpoint, the shape in current model is "
           "[128]"},
      {"norm-2d",
       norm,
       "F32",
       {128, 1},
       "size mismatch for '" + norm +
           "': copying a param with shape [128, 1] from checkpoint, the shape in current model is "
           "[128]"},
      {"norm-int",
       norm,
       "I32",
       {128},
       "'" + norm +
           "' is stored as I32; only floating-point tensors convert to the model's float32 "
           "parameters"},
  };
  // A NaN value: the same refusal, named by the rank that holds it.
  {
    const auto dir = checkpoint("nan");
    SafetensorsEdit file(dir / "model.safetensors");
    auto& down = file["model.layers.3.mlp.down_proj.weight"];
    down.bytes.replace(down.bytes.size() - 4, 4, std::string("\x00\x00\xc0\x7f", 4));
    file.write(dir / "model.safetensors");
    const auto out = dir_ / "out";
    const std::string message = "model directory '" + dir.string() +
                                "': 'model.layers.3.mlp.down_proj.weight' holds non-finite "
                                "values (nan or inf)";
    expect_refused(mdist(2, {"eval", "--model", dir.string(), "--out", (out / "e.json").string()}),
                   "eval", message, out);
    expect_refused(mdist(2, train_args({"--model", dir.string(), "--out", out.string()})), "train",
                   message, out);
  }
  for (const auto& c : cases) {
    const auto dir = checkpoint(c.name);
    SafetensorsEdit file(dir / "model.safetensors");
    std::int64_t numel = 1;
    for (const auto d : c.shape) numel *= d;
    file[c.key] = {c.dtype, c.shape, std::string(static_cast<std::size_t>(numel) * 4, '\0')};
    file.write(dir / "model.safetensors");
    const std::string message = "model directory '" + dir.string() + "': " + c.message;
    const auto out = dir_ / "out";
    expect_refused(mdist(2, {"eval", "--model", dir.string(), "--out", (out / "e.json").string()}),
                   "eval", message, out);
    expect_refused(mdist(2, {"eval", "--model", dir.string(), "--tp", "2", "--out",
                             (out / "e.json").string()}),
                   "eval", message, out);
    expect_refused(mdist(1, train_args({"--model", dir.string(), "--out", out.string()})), "train",
                   message, out);
  }
}

// Norm weights of 1 stored as float8 (E4M3), bfloat16 or float16 convert exactly: the same
// loss as float32 ones.
TEST_F(MdistChecks, FloatingPointCheckpointDtypesConvertExactly) {
  std::vector<double> losses;
  for (const auto& [dtype, one] :
       std::vector<std::pair<std::string, std::string>>{{"F32", std::string("\x00\x00\x80\x3f", 4)},
                                                        {"F8_E4M3", std::string("\x38", 1)},
                                                        {"BF16", std::string("\x80\x3f", 2)},
                                                        {"F16", std::string("\x00\x3c", 2)}}) {
    const auto dir = checkpoint("norm-" + dtype);
    SafetensorsEdit file(dir / "model.safetensors");
    for (auto& [name, t] : file.tensors()) {
      if (name.find("norm.weight") != std::string::npos)
        t = {dtype, t.shape, repeat_bytes(one, 128)};
    }
    file.write(dir / "model.safetensors");
    const auto json = dir_ / ("eval-" + dtype + ".json");
    const auto r =
        mdist(1, {"eval", "--model", dir.string(), "--seq-len", "32", "--out", json.string()});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    losses.push_back(nlohmann::json::parse(read(json))["loss"]);
  }
  for (std::size_t i = 1; i < losses.size(); ++i) EXPECT_EQ(losses[i], losses[0]) << i;
}

// A bfloat16 checkpoint trains in float32 and is saved with a config that says so: the
// config's dtype and the tensors' always agree.
TEST_F(MdistChecks, SavedConfigNamesTheDtypeOfTheSavedTensors) {
  const auto dir = checkpoint("bf16");
  SafetensorsEdit file(dir / "model.safetensors");
  for (auto& [name, t] : file.tensors()) {
    std::string bf16;
    for (std::size_t i = 0; i < t.bytes.size(); i += 4) bf16 += t.bytes.substr(i + 2, 2);
    t = {"BF16", t.shape, bf16};
  }
  file.write(dir / "model.safetensors");
  auto config = nlohmann::json::parse(read(dir / "config.json"));
  config["torch_dtype"] = "bfloat16";
  std::ofstream(dir / "config.json") << config.dump(2);
  const auto run = dir_ / "run";
  const auto r =
      mdist(1, train_args({"--model", dir.string(), "--steps", "1", "--out", run.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto saved = run / "checkpoints" / "step-00000001";
  EXPECT_EQ(nlohmann::json::parse(read(saved / "config.json"))["torch_dtype"], "float32");
  SafetensorsEdit written(saved / "model.safetensors");
  for (auto& [name, t] : written.tensors()) EXPECT_EQ(t.dtype, "F32") << name;
}

// A non-finite loss or gradient norm stops the run before the optimizer step: nothing saved,
// nothing pruned, one line. With --skip-nonfinite-steps the step is skipped (the weights stay
// as they were) and counted.
TEST_F(MdistChecks, ANonFiniteStepStopsBeforeTheUpdateOrIsSkippedOnRequest) {
  const auto run = dir_ / "run";
  const auto args = train_args(
      {"--lr", "1e30", "--warmup", "0", "--steps", "4", "--save-every", "1", "--keep", "5"});
  auto r = mdist(2, with(args, {"--out", run.string()}));
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("[rank0]: mdist train: error: step 2: the "));
  EXPECT_THAT(r.err, HasSubstr("; stopped before the optimizer step, nothing saved (the last "
                               "checkpoint is " +
                               (run / "checkpoints" / "step-00000001").string() +
                               "). Lower --lr, or pass --skip-nonfinite-steps to skip such steps"));
  EXPECT_EQ(error_lines(r.err), 1) << r.err;
  std::set<std::string> checkpoints;
  for (const auto& entry : fs::directory_iterator(run / "checkpoints")) {
    checkpoints.insert(entry.path().filename().string());
  }
  EXPECT_EQ(checkpoints, (std::set<std::string>{"latest", "step-00000001"}));
  EXPECT_EQ(read(run / "checkpoints" / "latest"), "step-00000001\n");

  const auto skipping = dir_ / "skipping";
  r = mdist(2, with(args, {"--out", skipping.string(), "--skip-nonfinite-steps"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto steps = metrics(skipping);
  ASSERT_EQ(steps.size(), 4u);
  EXPECT_FALSE(steps[0]["skipped"].get<bool>());
  EXPECT_TRUE(steps[1]["skipped"].get<bool>());
  EXPECT_EQ(steps[3]["skipped_steps"], 3);
  const auto ckpt = skipping / "checkpoints";
  EXPECT_EQ(read(ckpt / "step-00000004" / "model.safetensors"),
            read(ckpt / "step-00000001" / "model.safetensors"));
  EXPECT_EQ(
      nlohmann::json::parse(read(ckpt / "step-00000004" / "trainer_state.json"))["skipped_steps"],
      3);
}

// A second run into a directory a run is writing gets one line naming the first's pid.
TEST_F(MdistChecks, ASecondRunIntoTheSameDirectoryIsKeptOut) {
  const auto run = dir_ / "run";
  std::vector<std::string> argv = {MDIST_LAUNCHER, "--nproc-per-node", "1", MDIST_CLI};
  for (const auto& a :
       train_args({"--steps", "100000", "--save-every", "0", "--out", run.string()}))
    argv.push_back(a);
  const pid_t first = spawn(argv);
  ASSERT_GT(first, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!fs::exists(run / "metrics.jsonl") && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const auto r = mdist(2, train_args({"--steps", "2", "--out", run.string(), "--overwrite"}));
  kill(first, SIGTERM);
  int status = 0;
  waitpid(first, &status, 0);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("[rank0]: mdist train: error: output directory '" + run.string() +
                               "' is in use by another run (pid "));
  EXPECT_EQ(error_lines(r.err), 1) << r.err;
  EXPECT_FALSE(fs::exists(run / "checkpoints")) << "the second run wrote";
}

// A hand-edited or damaged checkpoint is refused by --resume with one line naming the file,
// before anything is loaded or removed.
TEST_F(MdistChecks, ResumeValidatesTheTrainerStateAndTheOptimizerFiles) {
  const auto original = dir_ / "original";
  auto r = mdist(2, train_args({"--steps", "4", "--save-every", "2", "--out", original.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  struct Case {
    std::string name;
    std::function<void(const fs::path&)> damage;
    std::string message;
  };
  const auto edit_state = [](const std::function<void(nlohmann::json&)>& edit) {
    return [edit](const fs::path& ckpt) {
      auto state = nlohmann::json::parse(read(ckpt / "trainer_state.json"));
      edit(state);
      std::ofstream(ckpt / "trainer_state.json") << state.dump(2);
    };
  };
  const std::vector<Case> cases = {
      {"negative-step", edit_state([](auto& s) { s["step"] = -1; }),
       "trainer_state.json': step -1 is not a step (>= 1)"},
      {"step-not-the-directorys", edit_state([](auto& s) { s["step"] = 9; }),
       "trainer_state.json': step 9 is not the directory's (step-00000004)"},
      {"data-position", edit_state([](auto& s) { s["sequences_seen"] = 7; }),
       "trainer_state.json': sequences_seen 7 is not step 4 x global_batch 4"},
      {"layout", edit_state([](auto& s) { s["tensor_parallel"] = 3; }),
       "trainer_state.json': world_size 2 and tensor_parallel 3 are not a layout"},
      {"rng", edit_state([](auto& s) { s["cpu_rng_state"] = "abcd"; }),
       "trainer_state.json': cpu_rng_state is not a state of this libtorch's CPU generator"},
      {"truncated-optimizer",
       [](const fs::path& ckpt) {
         const auto file = ckpt / "optimizer" / "rank-00001-of-00002.safetensors";
         fs::resize_file(file, fs::file_size(file) / 2);
       },
       "optimizer state file '"},
      {"missing-optimizer",
       [](const fs::path& ckpt) {
         fs::remove(ckpt / "optimizer" / "rank-00001-of-00002.safetensors");
       },
       "optimizer/rank-00001-of-00002.safetensors is missing (the checkpoint is incomplete)"},
      // Damage that no interrupted save leaves: no silent fall-back to step 2.
      {"latest-names-a-missing-step", [](const fs::path& ckpt) { fs::remove_all(ckpt); },
       "checkpoints/latest' names step-00000004, which does not exist (removed or damaged); to "
       "continue from an earlier checkpoint, write its name into "},
      {"newest-without-trainer-state",
       [](const fs::path& ckpt) { fs::remove(ckpt / "trainer_state.json"); },
       "step-00000004' is damaged (no trainer_state.json); to continue from an earlier "
       "checkpoint, write its name into "},
  };
  for (const auto& c : cases) {
    const auto run = dir_ / c.name;
    fs::copy(original, run, fs::copy_options::recursive);
    c.damage(run / "checkpoints" / "step-00000004");
    const auto before = tree(run);
    r = mdist(2,
              train_args({"--steps", "6", "--save-every", "2", "--out", run.string(), "--resume"}));
    EXPECT_EQ(r.exit_code, 2) << c.name << "\n" << describe(r);
    EXPECT_THAT(r.err, HasSubstr("[rank0]: mdist train: error: ")) << c.name;
    EXPECT_THAT(r.err, HasSubstr(c.message)) << c.name;
    EXPECT_EQ(error_lines(r.err), 1) << c.name << "\n" << r.err;
    EXPECT_EQ(tree(run), before) << c.name;
  }
}

// A checkpoint that cannot be written (here: a file-size limit, as a full disk) ends the run
// with one line; no partial hidden directory is left and `latest` still names the last good one.
TEST_F(MdistChecks, ACheckpointThatCannotBeWrittenLeavesNoPartialDirectory) {
  const auto run = dir_ / "run";
  auto r = mdist(2, train_args({"--steps", "2", "--save-every", "2", "--out", run.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  std::string command = "trap '' XFSZ; ulimit -f 512; exec " + std::string(MDIST_LAUNCHER) +
                        " --nproc-per-node 2 " + MDIST_CLI;
  for (const auto& a :
       train_args({"--steps", "4", "--save-every", "2", "--out", run.string(), "--resume"})) {
    command += " " + a;
  }
  mdist::testing::RunOptions options;
  options.env["OMP_NUM_THREADS"] = "1";
  options.timeout = std::chrono::seconds(240);
  r = mdist::testing::run({"/bin/bash", "-c", command}, options);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("[rank0]: mdist train: error: cannot write checkpoint " +
                               (run / "checkpoints" / "step-00000004").string()));
  EXPECT_THAT(r.err, HasSubstr("; the previous checkpoint is kept"));
  EXPECT_EQ(error_lines(r.err), 1) << r.err;
  std::set<std::string> left;
  for (const auto& entry : fs::directory_iterator(run / "checkpoints")) {
    left.insert(entry.path().filename().string());
  }
  EXPECT_EQ(left, (std::set<std::string>{"latest", "step-00000002"}));
  EXPECT_EQ(read(run / "checkpoints" / "latest"), "step-00000002\n");
}

// A tied head is a Linear in transformers: calibrate reports it as lm_head, its input the
// final norm's output (the same as the untied model's head input) and its weight the
// embedding's maximum, on one rank and split over two.
TEST_F(MdistChecks, CalibrateReportsATiedHeadUnderItsHuggingFaceName) {
  const auto untied = checkpoint("untied");
  const auto tied = checkpoint("tied");
  SafetensorsEdit file(tied / "model.safetensors");
  float embed_max = 0;
  for (const float v : file.floats("model.embed_tokens.weight"))
    embed_max = std::max(embed_max, std::abs(v));
  file.erase("lm_head.weight");
  file.write(tied / "model.safetensors");
  auto config = nlohmann::json::parse(read(tied / "config.json"));
  config["tie_word_embeddings"] = true;
  std::ofstream(tied / "config.json") << config.dump(2);
  const auto calibrate = [&](const fs::path& model, int ranks, const std::string& tp) {
    const auto out = dir_ / ("calibration-" + model.filename().string() + tp + ".json");
    const auto r = mdist(ranks, {"calibrate", "--model", model.string(), "--seq-len", "32",
                                 "--max-sequences", "4", "--tp", tp, "--out", out.string()});
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    return nlohmann::json::parse(read(out))["modules"];
  };
  const auto reference = calibrate(untied, 1, "1");
  for (const auto& [ranks, tp] : std::vector<std::pair<int, std::string>>{{1, "1"}, {2, "2"}}) {
    const auto modules = calibrate(tied, ranks, tp);
    ASSERT_TRUE(modules.contains("lm_head")) << modules.dump();
    EXPECT_EQ(modules.size(), reference.size());
    EXPECT_NEAR(modules["lm_head"]["input_absmax"].get<double>(),
                reference["lm_head"]["input_absmax"].get<double>(),
                1e-6 * reference["lm_head"]["input_absmax"].get<double>());
    EXPECT_EQ(modules["lm_head"]["weight_absmax"].get<double>(), static_cast<double>(embed_max));
  }
}

// --eval-every K logs the held-out loss (the embedded corpus' eval split) at every K steps; it
// is the loss `mdist eval` gives for that step's checkpoint, and the same on 1 and 2 ranks.
TEST_F(MdistChecks, TrainLogsTheHeldOutLossItsCheckpointsEvaluateTo) {
  std::vector<std::vector<nlohmann::json>> runs;
  for (const int ranks : {1, 2}) {
    const auto run = dir_ / ("np" + std::to_string(ranks));
    const auto r =
        mdist(ranks, train_args({"--steps", "4", "--save-every", "2", "--keep", "5", "--eval-every",
                                 "2", "--eval-max-sequences", "0", "--out", run.string()}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_THAT(r.out, HasSubstr("held-out loss"));
    runs.push_back(metrics(run, "eval_loss"));
    ASSERT_EQ(runs.back().size(), 2u);
    EXPECT_EQ(runs.back()[0]["step"], 2);
    EXPECT_THAT(read(run / "loss.svg"), HasSubstr("held out"));
  }
  for (std::size_t i = 0; i < 2; ++i) {
    const double a = runs[0][i]["eval_loss"], b = runs[1][i]["eval_loss"];
    EXPECT_NEAR(b, a, 1e-6 * a);
  }
  const auto json = dir_ / "eval.json";
  const auto r =
      mdist(1, {"eval", "--model", (dir_ / "np1" / "checkpoints" / "step-00000002").string(),
                "--seq-len", "32", "--out", json.string()});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const double evaluated = nlohmann::json::parse(read(json))["loss"];
  EXPECT_NEAR(runs[0][0]["eval_loss"].get<double>(), evaluated, 1e-6 * evaluated);
  // --model takes what a run leaves: its directory and its checkpoints/latest pointer stand for
  // the latest checkpoint (step 4), which the log names; the same loss as the step directory.
  const auto run = dir_ / "np1";
  const auto latest = run / "checkpoints" / "step-00000004";
  std::vector<double> losses;
  for (const auto& model : {latest, run, run / "checkpoints" / "latest"}) {
    const auto e =
        mdist(1, {"eval", "--model", model.string(), "--seq-len", "32", "--out", json.string()});
    ASSERT_EQ(e.exit_code, 0) << model << "\n" << describe(e);
    if (model != latest) {
      EXPECT_THAT(e.out, HasSubstr("mdist eval: model " + latest.string() +
                                   " (LlamaForCausalLM; the latest checkpoint of the run " +
                                   run.string() + ")"));
    }
    losses.push_back(nlohmann::json::parse(read(json))["loss"]);
  }
  EXPECT_EQ(losses[1], losses[0]);
  EXPECT_EQ(losses[2], losses[0]);
  EXPECT_NEAR(runs[0][1]["eval_loss"].get<double>(), losses[0], 1e-6 * losses[0]);
  const auto empty = dir_ / "empty-run";
  fs::create_directories(empty / "checkpoints");
  const auto e = mdist(1, {"eval", "--model", empty.string(), "--seq-len", "32"});
  EXPECT_EQ(e.exit_code, 2) << describe(e);
  EXPECT_THAT(e.err, HasSubstr("mdist eval: error: --model '" + empty.string() + "': the run '" +
                               empty.string() + "' has no complete checkpoint yet"));
}

// Usage errors: exit code 2 and one line (from rank 0 only), a mistyped subcommand gets the
// nearest one; eval --out into directories that do not exist yet creates them.
// --param-dtype bf16 (FSDP2's mixed precision: gathered and computed in bf16, gradients reduced
// in fp32, fp32 weights and AdamW state). The bf16 run must really compute in bf16 (its first
// loss differs from the fp32 run's, by bf16 rounding only), train as the fp32 run does, give the
// same losses on 1 and 2 ranks and under tensor parallelism, keep fp32 weights in its
// checkpoints, and resume on the checkpoint path with the policy applied again.
TEST_F(MdistChecks, Bf16MixedPrecisionComputesInBf16AndKeepsFp32Weights) {
  const auto run = [&](int ranks, const std::string& name, std::vector<std::string> more) {
    const auto out = dir_ / name;
    const auto r = mdist(ranks, with(train_args({"--steps", "8", "--out", out.string()}), more));
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    return std::make_pair(r, metrics(out));
  };
  const auto [fp32_run, fp32] = run(2, "fp32", {"--save-every", "0"});
  const std::vector<std::string> bf16_flags = {"--param-dtype", "bf16"};
  const auto [bf16_run, bf16] =
      run(2, "bf16",
          with(bf16_flags, {"--save-every", "4", "--keep", "5", "--eval-max-sequences", "0"}));
  const auto [one_run, one] = run(1, "bf16-one", with(bf16_flags, {"--save-every", "0"}));
  const auto [tp_run, tp] = run(2, "bf16-tp", with(bf16_flags, {"--save-every", "0", "--tp", "2"}));
  ASSERT_EQ(fp32.size(), 8u);
  ASSERT_EQ(bf16.size(), 8u);
  ASSERT_EQ(one.size(), 8u);
  ASSERT_EQ(tp.size(), 8u);
  EXPECT_THAT(bf16_run.out, HasSubstr("mixed precision: gathered and computed in bf16, gradients "
                                      "reduced in fp32, weights (and AdamW state) in fp32"));
  EXPECT_THAT(fp32_run.out, Not(HasSubstr("mixed precision")));
  const double first_fp32 = fp32[0]["loss"], first_bf16 = bf16[0]["loss"];
  EXPECT_NE(first_bf16, first_fp32) << "--param-dtype bf16 computed in fp32";
  EXPECT_NEAR(first_bf16, first_fp32, 1e-3 * first_fp32);
  for (std::size_t i = 0; i < 8; ++i) {
    const double a = fp32[i]["loss"], b = bf16[i]["loss"];
    EXPECT_NEAR(b, a, 1e-2 * a) << "step " << i + 1;
    EXPECT_NEAR(one[i]["loss"].get<double>(), b, 2e-3 * b) << "step " << i + 1;
    EXPECT_NEAR(tp[i]["loss"].get<double>(), b, 2e-3 * b) << "step " << i + 1;
  }
  EXPECT_LT(bf16[7]["loss"].get<double>(), bf16[0]["loss"].get<double>());
  // The checkpoint holds the fp32 master weights, and says so in its config.
  const auto step4 = dir_ / "bf16" / "checkpoints" / "step-00000004";
  SafetensorsEdit saved(step4 / "model.safetensors");
  ASSERT_FALSE(saved.tensors().empty());
  for (const auto& [name, t] : saved.tensors()) EXPECT_EQ(t.dtype, "F32") << name;
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(step4 / "config.json"))["torch_dtype"], "float32");
  // The held-out loss logged in bf16 at the checkpoint is what `mdist eval --param-dtype bf16`
  // gives for it, on 1 rank with eval's own batch size too; in fp32, eval gives another number.
  const auto held = metrics(dir_ / "bf16", "eval_loss");
  ASSERT_EQ(held.size(), 2u);
  ASSERT_EQ(held[0]["step"], 4);
  const auto evaluate = [&](int ranks, std::vector<std::string> more) {
    const auto json = dir_ / "eval.json";
    const auto r = mdist(
        ranks,
        with({"eval", "--model", step4.string(), "--seq-len", "32", "--out", json.string()}, more));
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    return nlohmann::json::parse(read(json))["loss"].get<double>();
  };
  const double logged = held[0]["eval_loss"];
  const double same_layout = evaluate(2, with(bf16_flags, {"--batch-size", "2"}));
  const double one_rank = evaluate(1, bf16_flags);
  const double in_fp32 = evaluate(1, {});
  EXPECT_NEAR(same_layout, logged, 1e-6 * logged);
  EXPECT_NEAR(one_rank, logged, 1e-6 * logged);
  EXPECT_GT(std::abs(in_fp32 - logged), 1e-5 * logged) << "eval --param-dtype bf16 ran in fp32";
  std::cout << std::setprecision(9) << "held-out loss at step 4: train (bf16) " << logged
            << ", eval bf16 " << same_layout << " (2 ranks, batch 2) / " << one_rank
            << " (1 rank, batch 8), eval fp32 " << in_fp32 << std::endl;
  // Resumed from step 4 (the model read from the checkpoint, wrapped with the policy again):
  // the same losses as the uninterrupted bf16 run.
  const auto cut = dir_ / "cut";
  fs::copy(dir_ / "bf16", cut, fs::copy_options::recursive);
  fs::remove_all(cut / "checkpoints" / "step-00000008");
  std::ofstream(cut / "checkpoints" / "latest") << "step-00000004\n";
  const auto r = mdist(
      2, with(train_args({"--steps", "8", "--out", cut.string(), "--resume", "--save-every", "4"}),
              bf16_flags));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto resumed = metrics(cut);
  ASSERT_EQ(resumed.size(), 8u);
  for (std::size_t i = 4; i < 8; ++i) {
    const double a = bf16[i]["loss"], b = resumed[i]["loss"];
    EXPECT_NEAR(b, a, 1e-6 * a) << "step " << i + 1;
  }
}

// --micro-batch: the rank's batch in micro-batches with their gradients accumulated gives the
// losses of one forward (fp32 and bf16), says so in the log, and a run with micro-batches
// resumes exactly (into the same or another micro-batch size); a bad size is one line, exit 2,
// nothing written.
TEST_F(MdistChecks, MicroBatchesTrainAsOneBatchAndResumeExactly) {
  // --global-batch 8 on 2 ranks: 4 sequences per rank, as 4 micro-batches of 1 or 2 of 2.
  const auto args = train_args({"--steps", "6", "--global-batch", "8", "--eval-every", "0"});
  const auto run = [&](const std::string& name, std::vector<std::string> more) {
    const auto out = dir_ / name;
    const auto r = mdist(2, with(with(args, {"--out", out.string()}), more));
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    return std::make_pair(r, metrics(out));
  };
  const auto [whole_run, whole] = run("whole", {"--save-every", "0"});
  const auto [micro_run, micro] =
      run("micro", {"--micro-batch", "1", "--save-every", "3", "--keep", "5"});
  EXPECT_THAT(whole_run.out, HasSubstr("(4 per data-parallel rank, 1 forward per step)"));
  EXPECT_THAT(micro_run.out, HasSubstr("(4 per data-parallel rank, 4 micro-batches of 1 "
                                       "sequence per step, gradients accumulated)"));
  // Each step's loss of `micro` within `bound` (relative) of `whole`'s; prints the largest gap.
  const auto expect_same_losses = [](const auto& whole_losses, const auto& micro_losses,
                                     double bound, const std::string& what) {
    ASSERT_EQ(whole_losses.size(), 6u) << what;
    ASSERT_EQ(micro_losses.size(), 6u) << what;
    double worst = 0;
    for (std::size_t i = 0; i < 6; ++i) {
      const double a = whole_losses[i]["loss"], b = micro_losses[i]["loss"];
      EXPECT_NEAR(b, a, bound * a) << what << ", step " << i + 1;
      worst = std::max(worst, std::abs(b - a) / a);
    }
    std::cout << what << " against one forward: losses within " << worst << " (relative)"
              << std::endl;
  };
  expect_same_losses(whole, micro, 1e-6, "fp32: 4 micro-batches");
  // Resumed from step 3 with the same micro-batches (bit for bit) and with others.
  for (const std::string size : {"1", "2", "4"}) {
    const auto cut = dir_ / ("cut-" + size);
    fs::copy(dir_ / "micro", cut, fs::copy_options::recursive);
    fs::remove_all(cut / "checkpoints" / "step-00000006");
    std::ofstream(cut / "checkpoints" / "latest") << "step-00000003\n";
    const auto r = mdist(2, with(args, {"--out", cut.string(), "--resume", "--save-every", "3",
                                        "--micro-batch", size}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    const auto resumed = metrics(cut);
    ASSERT_EQ(resumed.size(), 6u);
    for (std::size_t i = 3; i < 6; ++i) {
      const double a = micro[i]["loss"], b = resumed[i]["loss"];
      if (size == "1") {
        EXPECT_EQ(b, a) << "step " << i + 1 << ", resumed with --micro-batch " << size;
      } else {
        EXPECT_NEAR(b, a, 1e-6 * a) << "step " << i + 1 << ", resumed with --micro-batch " << size;
      }
    }
  }
  // bf16: the micro-batches' bf16 gradients accumulate unreduced before the fp32
  // reduce-scatter, so they agree with one bf16 forward as bf16 runs agree among themselves.
  const auto [bf16_run, bf16] = run("bf16", {"--param-dtype", "bf16", "--save-every", "0"});
  const auto [bf16_micro_run, bf16_micro] =
      run("bf16-micro", {"--param-dtype", "bf16", "--micro-batch", "2", "--save-every", "0"});
  expect_same_losses(bf16, bf16_micro, 2e-3, "bf16: 2 micro-batches");
}

TEST_F(MdistChecks, UsageErrorsAreOneLineWithExitCodeTwo) {
  auto r = mdist(2, {"trian"});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(
      r.err,
      HasSubstr(
          "[rank0]: mdist: error: unknown subcommand 'trian' (did you mean "
          "'train'?); the subcommands are train, eval, calibrate, quantize, generate, tokenize, "
          "info"));
  EXPECT_EQ(error_lines(r.err), 1) << r.err;
  r = mdist(2, {"train", "--no-such-flag"});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("[rank0]: mdist train: error: The following argument was not "
                               "expected: --no-such-flag"));
  EXPECT_EQ(error_lines(r.err), 1) << r.err;
  r = mdist(1, {});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  const auto nested = dir_ / "no" / "such" / "dir" / "e.json";
  r = mdist(1, {"eval", "--seq-len", "32", "--out", nested.string()});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(fs::exists(nested));
}

// --timeout bounds how long the others wait for a stopped rank: the job ends, non-zero, well
// before torch's 30-minute default; before that the watchdog on rank 0 names the rank.
TEST_F(MdistChecks, TimeoutEndsAJobWhoseRankStoppedAndTheWatchdogNamesIt) {
  const auto run = dir_ / "run";
  std::vector<std::string> argv = {MDIST_LAUNCHER, "--nproc-per-node", "2", MDIST_CLI};
  for (const auto& a : train_args({"--steps", "100000", "--save-every", "0", "--timeout", "8",
                                   "--watchdog", "1", "--out", run.string()}))
    argv.push_back(a);
  const pid_t launcher = spawn(argv, dir_ / "job.log");
  ASSERT_GT(launcher, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (metrics(run).size() < 3 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const pid_t victim = rank_process(launcher, 1);
  ASSERT_GT(victim, 0) << read(dir_ / "job.log");
  const auto stopped = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(victim, SIGSTOP), 0);
  int status = 0;
  ASSERT_EQ(waitpid(launcher, &status, 0), launcher);
  const auto waited = std::chrono::steady_clock::now() - stopped;
  kill(victim, SIGKILL);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << read(dir_ / "job.log");
  EXPECT_LT(waited, std::chrono::seconds(90)) << read(dir_ / "job.log");
  EXPECT_THAT(read(dir_ / "job.log"),
              HasSubstr("[rank0]: mdist train: watchdog: rank 1 has given no sign of life for "));
}

// --resume auto: the same command line starts a run (no checkpoint yet) and continues it after
// an interruption, with the uninterrupted run's losses; a bare --resume still needs a checkpoint.
TEST_F(MdistChecks, ResumeAutoStartsThenContinuesAnInterruptedRun) {
  const auto args = train_args({"--steps", "6", "--save-every", "2", "--keep", "5"});
  const auto whole = dir_ / "whole";
  auto r = mdist(2, with(args, {"--out", whole.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto run = dir_ / "run";
  r = mdist(2, with(args, {"--out", run.string(), "--resume", "auto"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("(--resume auto: no checkpoint yet, starting)"));
  // Interrupted after step 4: the step-6 checkpoint and what came after step 4 are gone.
  fs::remove_all(run / "checkpoints" / "step-00000006");
  std::ofstream(run / "checkpoints" / "latest") << "step-00000004\n";
  r = mdist(2, with(args, {"--out", run.string(), "--resume", "auto"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out,
              HasSubstr("(resumed from " + (run / "checkpoints" / "step-00000004").string()));
  const auto expected = metrics(whole), resumed = metrics(run);
  ASSERT_EQ(resumed.size(), 6u);
  for (std::size_t i = 0; i < 6; ++i) {
    const double a = expected[i]["loss"], b = resumed[i]["loss"];
    EXPECT_NEAR(b, a, 1e-6 * a) << "step " << i + 1;
  }
  const auto empty = dir_ / "empty";
  r = mdist(1, with(args, {"--out", empty.string(), "--resume"}));
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("mdist train: error: --resume: no checkpoint in '" +
                               (empty / "checkpoints").string() + "'"));
}

// --resume auto on a run that has reached --steps (a restart after a rank died in teardown):
// "already complete", exit 0, nothing written; a bare --resume still refuses it.
TEST_F(MdistChecks, ResumeAutoOnAFinishedRunIsCompleteAndWritesNothing) {
  const auto run = dir_ / "run";
  const auto args = train_args({"--steps", "2", "--save-every", "1", "--out", run.string()});
  auto r = mdist(2, args);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto snapshot = [&] {
    std::map<std::string, std::pair<std::string, fs::file_time_type>> files;
    for (const auto& entry : fs::recursive_directory_iterator(run)) {
      files[fs::relative(entry.path(), run).string()] = {
          entry.is_regular_file() ? read(entry.path()) : "", fs::last_write_time(entry.path())};
    }
    return files;
  };
  const auto before = snapshot();
  r = mdist(2, with(args, {"--resume", "auto"}));
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out,
              HasSubstr("mdist train: the run in " + run.string() + " is already complete (" +
                        (run / "checkpoints" / "step-00000002").string() +
                        " is at step 2 of --steps 2); nothing to do, nothing written"));
  EXPECT_TRUE(snapshot() == before) << "a finished run was written to";
  // Under mdistrun --max-restarts the same: one attempt, exit 0.
  const std::vector<std::string> argv = {
      MDIST_LAUNCHER, "--nproc-per-node", "2", "--max-restarts", "2", MDIST_CLI};
  r = mdist::testing::run(with(with(argv, args), {"--resume", "auto"}));
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(snapshot() == before) << "a finished run was written to";
  r = mdist(2, with(args, {"--resume"}));
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("--resume: the checkpoint is at step 2, not before --steps 2"));
}

// A step skipped as non-finite (--skip-nonfinite-steps; the NaN injected by
// MDIST_FAULT_NONFINITE_STEPS) leaves every parameter's AdamW step one behind the trainer's;
// a run resumed from a checkpoint after it continues exactly as the uninterrupted run.
TEST_F(MdistChecks, ResumeAfterASkippedStepIsExact) {
  const std::map<std::string, std::string> fault = {{"MDIST_FAULT_NONFINITE_STEPS", "2"}};
  const auto args = train_args({"--steps", "6", "--save-every", "1", "--keep", "10",
                                "--skip-nonfinite-steps", "--eval-every", "0"});
  const auto whole = dir_ / "whole";
  auto r = mdist(2, with(args, {"--out", whole.string()}), fault);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const auto expected = metrics(whole);
  ASSERT_EQ(expected.size(), 6u);
  EXPECT_TRUE(expected[1]["skipped"].get<bool>());
  EXPECT_FALSE(expected[2]["skipped"].get<bool>());
  const auto cut = dir_ / "cut";
  fs::copy(whole, cut, fs::copy_options::recursive);
  for (const char* later : {"step-00000004", "step-00000005", "step-00000006"}) {
    fs::remove_all(cut / "checkpoints" / later);
  }
  std::ofstream(cut / "checkpoints" / "latest") << "step-00000003\n";
  r = mdist(2, with(args, {"--out", cut.string(), "--resume"}), fault);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, Not(HasSubstr("warning")));
  const auto resumed = metrics(cut);
  ASSERT_EQ(resumed.size(), 6u);
  for (std::size_t i = 3; i < 6; ++i) {
    const double a = expected[i]["loss"], b = resumed[i]["loss"];
    EXPECT_NEAR(b, a, 1e-6 * a) << "step " << i + 1;
  }
  SafetensorsEdit x(whole / "checkpoints" / "step-00000006" / "model.safetensors");
  SafetensorsEdit y(cut / "checkpoints" / "step-00000006" / "model.safetensors");
  for (auto& [name, tensor] : x.tensors()) {
    const auto a = x.floats(name), b = y.floats(name);
    ASSERT_EQ(a.size(), b.size()) << name;
    for (std::size_t i = 0; i < a.size(); ++i) {
      ASSERT_NEAR(b[i], a[i], 1e-6 * std::max(1.0F, std::abs(a[i]))) << name << "[" << i << "]";
    }
  }
}

// What an interrupted save leaves is resumed from with one warning line each, naming what was
// not used: no `latest` yet (a first save cut between its rename and the pointer), a newer
// complete step than `latest` names, a hidden .tmp- directory of a save that never finished.
TEST_F(MdistChecks, ResumeSaysWhichCheckpointItSkippedAndWhy) {
  const auto original = dir_ / "original";
  const auto args = train_args({"--steps", "6", "--save-every", "2", "--keep", "5"});
  auto r = mdist(1, with(args, {"--steps", "4", "--out", original.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  struct Case {
    std::string name;
    std::function<void(const fs::path&)> damage;
    std::string warning;
    std::string resumed_from;
  };
  const std::vector<Case> cases = {
      {"no-latest", [](const fs::path& c) { fs::remove(c / "latest"); },
       "' is missing (a save interrupted before it was written); using the newest complete "
       "checkpoint step-00000004",
       "step-00000004"},
      {"latest-behind", [](const fs::path& c) { std::ofstream(c / "latest") << "step-00000002\n"; },
       "checkpoints/latest names step-00000002; the newer step-00000004 is not used",
       "step-00000002"},
      {"interrupted-save",
       [](const fs::path& c) { fs::create_directories(c / ".tmp-step-00000006" / "optimizer"); },
       "an interrupted save of step-00000006 (checkpoints/.tmp-step-00000006) is ignored: the "
       "steps after step-00000004 are trained again",
       "step-00000004"},
      // An earlier mdist's optimizer files (format v2: moments only) still resume.
      {"earlier-format",
       [](const fs::path& c) {
         for (const auto& entry : fs::directory_iterator(c / "step-00000004" / "optimizer")) {
           SafetensorsEdit file(entry.path());
           std::vector<std::string> steps;
           for (const auto& [name, t] : file.tensors()) {
             if (name.ends_with("/step")) steps.push_back(name);
           }
           for (const auto& name : steps) {
             file.erase(name);
             file.metadata().erase(name);
           }
           file.metadata().erase("no_state");
           file.metadata().erase("cpu_rng_state");
           file.metadata()["format"] = "mdist.adamw.blocks.v2";
           file.write(entry.path());
         }
       },
       "(written by an earlier mdist) keeps no per-parameter AdamW step: every parameter resumes "
       "at step 4, which is not exact for a parameter that missed steps",
       "step-00000004"},
  };
  for (const auto& c : cases) {
    const auto run = dir_ / c.name;
    fs::copy(original, run, fs::copy_options::recursive);
    c.damage(run / "checkpoints");
    r = mdist(1, with(args, {"--out", run.string(), "--resume"}));
    ASSERT_EQ(r.exit_code, 0) << c.name << "\n" << describe(r);
    EXPECT_THAT(r.out, HasSubstr("mdist train: warning: ")) << c.name;
    EXPECT_THAT(r.out, HasSubstr(c.warning)) << c.name;
    EXPECT_THAT(r.out,
                HasSubstr("(resumed from " + (run / "checkpoints" / c.resumed_from).string()))
        << c.name;
    EXPECT_EQ(metrics(run).size(), 6u) << c.name;
  }
}

// Restarts that lose no training: rank 1 is SIGKILLed at 5 random moments of a run under
// mdistrun --max-restarts 5 with --resume auto and a checkpoint every step; the job completes,
// and its losses and final weights are the uninterrupted run's.
TEST_F(MdistChecks, RestartsAfterKilledRanksLoseNoTraining) {
  const auto args = train_args({"--steps", "80", "--save-every", "1", "--eval-every", "0"});
  const auto whole = dir_ / "whole";
  auto r = mdist(2, with(args, {"--out", whole.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);

  const auto run = dir_ / "run";
  std::vector<std::string> argv = {MDIST_LAUNCHER, "--nproc-per-node", "2", "--max-restarts", "5",
                                   MDIST_CLI};
  for (const auto& a : with(args, {"--out", run.string(), "--resume", "auto"})) argv.push_back(a);
  const pid_t launcher = spawn(argv, dir_ / "job.log");
  ASSERT_GT(launcher, 0);
  std::mt19937 random(static_cast<unsigned>(::getpid()));
  // A random moment of each attempt: during start-up, a step or a checkpoint.
  const auto [status, kills] =
      kill_rank_while_running(launcher, 1, 5, std::chrono::seconds(200), [&](int) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100 + random() % 900));
        return true;
      });
  EXPECT_EQ(kills, 5) << read(dir_ / "job.log");
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read(dir_ / "job.log");
  const auto expected = metrics(whole), restarted = metrics(run);
  ASSERT_EQ(restarted.size(), 80u) << read(dir_ / "job.log");
  for (std::size_t i = 0; i < 80; ++i) {
    EXPECT_EQ(restarted[i]["step"], i + 1);
    const double a = expected[i]["loss"], b = restarted[i]["loss"];
    EXPECT_NEAR(b, a, 1e-6 * a) << "step " << i + 1;
  }
  const auto final_weights = [](const fs::path& out) {
    return SafetensorsEdit(out / "checkpoints" / "step-00000080" / "model.safetensors");
  };
  auto a = final_weights(whole), b = final_weights(run);
  for (auto& [name, tensor] : a.tensors()) {
    const auto x = a.floats(name), y = b.floats(name);
    ASSERT_EQ(x.size(), y.size()) << name;
    for (std::size_t i = 0; i < x.size(); ++i) {
      ASSERT_NEAR(y[i], x[i], 1e-6 * std::max(1.0F, std::abs(x[i]))) << name << "[" << i << "]";
    }
  }
}

}  // namespace

namespace {

// The largest peak RSS any rank reported in a run's metrics, MiB.
double peak_rss_of(const fs::path& run) {
  double peak = 0;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto json = nlohmann::json::parse(line, nullptr, false);
    if (!json.is_object() || !json.contains("peak_rss_mib")) continue;
    for (const double mib : json["peak_rss_mib"]) peak = std::max(peak, mib);
  }
  return peak;
}

}  // namespace

// Token files are memory-mapped and checked in chunks: training on a 2 GiB .u16 file peaks
// within 300 MiB of the same run on a 1 MiB file (the file is sparse: all ids 0, few disk
// blocks). Both runs on 2 ranks, which split the id range check.
TEST_F(MdistChecks, PeakMemoryOfTrainingDoesNotGrowWithTheDataFile) {
  constexpr std::uintmax_t kBig = std::uintmax_t{2} << 30;
  std::error_code ec;
  const auto space = fs::space(dir_, ec);
  if (ec || space.available < (std::uintmax_t{4} << 30)) {
    GTEST_SKIP() << "needs 4 GiB free under " << dir_ << " (the sparse file may be filled in)";
  }
  std::map<std::string, double> peaks;
  for (const auto& [name, bytes] :
       {std::pair<std::string, std::uintmax_t>{"small", 1u << 20}, {"big", kBig}}) {
    const auto data = dir_ / (name + ".u16");
    std::ofstream(data).close();
    fs::resize_file(data, bytes);
    const auto run = dir_ / ("run-" + name);
    const auto r =
        mdist(2, {"train", "--data", data.string(), "--seq-len", "128", "--global-batch", "4",
                  "--steps", "2", "--warmup", "1", "--eval-every", "0", "--out", run.string()});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_THAT(r.out, HasSubstr("(u16, all split: " + std::to_string(bytes / 2) + " tokens)"));
    peaks[name] = peak_rss_of(run);
    fs::remove(data);
  }
  RecordProperty("peak_rss_small_mib", std::to_string(peaks["small"]));
  RecordProperty("peak_rss_big_mib", std::to_string(peaks["big"]));
  std::cout << "peak RSS per rank: 1 MiB file " << peaks["small"] << " MiB, 2 GiB file "
            << peaks["big"] << " MiB\n";
  EXPECT_GT(peaks["small"], 0);
  EXPECT_LT(peaks["big"], peaks["small"] + 300);
}

// --- Issue 12: real tokenizers in the main job, `mdist tokenize`. ----------------------------

class MdistTokenizer : public MdistChecks {
 protected:
  // The default model's one-step checkpoint grown to a vocabulary of 1024 (the embedding and
  // head rows repeated), with the tokenizer fixture of `family` (tests/hf/tokenizer/fixtures,
  // checked against Python's `tokenizers` by tokenizer_test).
  fs::path tokenizer_model(const std::string& family, bool grow = true) {
    const auto model = checkpoint("model-" + family + (grow ? "" : "-256"));
    if (grow) {
      SafetensorsEdit weights(model / "model.safetensors");
      for (const char* name : {"model.embed_tokens.weight", "lm_head.weight"}) {
        auto& t = weights[name];
        t.shape[0] *= 4;
        t.bytes = repeat_bytes(t.bytes, 4);
      }
      weights.write(model / "model.safetensors");
      auto config = nlohmann::json::parse(read(model / "config.json"));
      config["vocab_size"] = 1024;
      std::ofstream(model / "config.json") << config.dump(2);
    }
    for (const char* file : {"tokenizer.json", "tokenizer_config.json"}) {
      fs::copy(fs::path(MDIST_TOKENIZER_FIXTURES) / family / file, model / file,
               fs::copy_options::overwrite_existing);
    }
    return model;
  }

  // The fixture corpus, repeated, with empty lines and a CRLF line: the documents `mdist
  // tokenize` reads as lines.
  fs::path corpus(int repeats = 3) {
    const auto path = dir_ / "corpus.txt";
    const std::string text = read(fs::path(MDIST_TOKENIZER_FIXTURES) / "corpus.txt");
    std::ofstream out(path, std::ios::binary);
    for (int i = 0; i < repeats; ++i) out << text << "\n\nline " << i << " ends in CRLF\r\n";
    return path;
  }

  // What `mdist tokenize` must write: encode(line, add_special_tokens) + EOS for every non-empty
  // line (a trailing '\r' removed), by the C++ Tokenizer itself.
  static std::vector<std::int32_t> expected_ids(const fs::path& model, const fs::path& text) {
    const auto tokenizer = mdist::hf::Tokenizer::from_directory(model);
    std::vector<std::int32_t> ids;
    std::istringstream lines(read(text));
    for (std::string line; std::getline(lines, line);) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty()) continue;
      const auto doc = tokenizer.encode(line, true);
      ids.insert(ids.end(), doc.begin(), doc.end());
      ids.push_back(tokenizer.eos_token_id().value());
    }
    return ids;
  }

  static std::vector<std::int32_t> u32_ids(const fs::path& path) {
    const std::string bytes = read(path);
    std::vector<std::int32_t> ids(bytes.size() / 4);
    std::memcpy(ids.data(), bytes.data(), ids.size() * 4);
    return ids;
  }
};

// `mdist tokenize` writes encode(doc) + EOS per line, the same bytes on 1, 2 and 3 ranks, for
// a SentencePiece-style (Llama 2: BOS added) and a byte-level (GPT-2) tokenizer; .u16 holds the
// same ids in 2 bytes; no hidden file is left behind.
TEST_F(MdistTokenizer, TokenizeWritesEncodePlusEosPerDocumentOnAnyRankCount) {
  const auto text = corpus();
  for (const std::string family : {"llama2", "gpt2"}) {
    const auto model = tokenizer_model(family);
    const auto expected = expected_ids(model, text);
    ASSERT_GT(expected.size(), 100u);
    std::string first;
    for (const int ranks : {1, 2, 3}) {
      const auto out = dir_ / ("tokens-" + family + "-" + std::to_string(ranks) + ".u32");
      const auto r = mdist(ranks, {"tokenize", "--model", model.string(), "--data", text.string(),
                                   "--out", out.string()});
      ASSERT_EQ(r.exit_code, 0) << describe(r);
      EXPECT_THAT(r.out, HasSubstr("tokenizer: "));
      EXPECT_THAT(r.out, HasSubstr(std::to_string(expected.size()) + " tokens (u32)"));
      EXPECT_EQ(u32_ids(out), expected) << family << " on " << ranks << " ranks";
      if (first.empty()) first = read(out);
      EXPECT_EQ(read(out), first);
    }
    const auto u16 = dir_ / ("tokens-" + family + ".u16");
    const auto r = mdist(
        2, {"tokenize", "--model", model.string(), "--data", text.string(), "--out", u16.string()});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    const std::string bytes = read(u16);
    ASSERT_EQ(bytes.size(), expected.size() * 2);
    for (std::size_t i = 0; i < expected.size(); ++i) {
      std::uint16_t id = 0;
      std::memcpy(&id, bytes.data() + 2 * i, 2);
      ASSERT_EQ(id, expected[i]) << i;
    }
  }
  for (const auto& entry : fs::directory_iterator(dir_)) {
    EXPECT_NE(entry.path().filename().string()[0], '.') << "left behind: " << entry.path();
  }
}

// JSON Lines (a field of each line) and paragraphs are documents too; one whole-file document
// is encoded in pieces and still equals encode(file) + EOS.
TEST_F(MdistTokenizer, TokenizeReadsJsonLinesParagraphsAndWholeDocuments) {
  const auto model = tokenizer_model("llama2");
  const auto tokenizer = mdist::hf::Tokenizer::from_directory(model);
  const std::vector<std::string> docs = {"First doc.\nWith two lines.", "Second: \"quoted\"",
                                         "caf\u00e9 \u00fcber"};
  const auto jsonl = dir_ / "docs.jsonl";
  const auto paragraphs = dir_ / "paragraphs.txt";
  {
    std::ofstream j(jsonl), p(paragraphs);
    for (const auto& doc : docs) {
      j << nlohmann::json{{"id", 1}, {"body", doc}}.dump() << "\n";
      p << doc << "\n\n\n";
    }
  }
  std::vector<std::int32_t> expected;
  for (const auto& doc : docs) {
    const auto ids = tokenizer.encode(doc, true);
    expected.insert(expected.end(), ids.begin(), ids.end());
    expected.push_back(*tokenizer.eos_token_id());
  }
  for (const int ranks : {1, 2}) {
    const auto a = dir_ / ("j" + std::to_string(ranks) + ".u32");
    auto r = mdist(ranks, {"tokenize", "--model", model.string(), "--data", jsonl.string(),
                           "--format", "jsonl", "--field", "body", "--out", a.string()});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_EQ(u32_ids(a), expected);
    const auto b = dir_ / ("p" + std::to_string(ranks) + ".u32");
    r = mdist(ranks, {"tokenize", "--model", model.string(), "--data", paragraphs.string(),
                      "--sample-by", "paragraph", "--out", b.string()});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_EQ(u32_ids(b), expected);
  }
  const auto text = corpus(40);  // about 65 KB: several pieces of the stream encoder
  const auto whole = dir_ / "whole.u32";
  const auto r = mdist(2, {"tokenize", "--model", model.string(), "--data", text.string(),
                           "--sample-by", "document", "--out", whole.string()});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  auto ids = tokenizer.encode(read(text), true);
  ids.push_back(*tokenizer.eos_token_id());
  EXPECT_EQ(u32_ids(whole), ids);
}

// Bad input to tokenize: one line from rank 0, exit code 2, no file written (hidden or not),
// and an earlier output at --out kept as it was.
TEST_F(MdistTokenizer, TokenizeBadInputIsOneLineAndWritesNothing) {
  const auto model = tokenizer_model("gpt2");
  fs::create_directories(dir_ / "no_tokenizer");
  std::ofstream(dir_ / "no_tokenizer" / "config.json") << "{}";
  const auto text = corpus(1);
  std::ofstream(dir_ / "missing_field.jsonl") << "{\"text\": \"a\"}\n{\"body\": \"b\"}\n";
  std::ofstream(dir_ / "not_json.jsonl") << "{\"text\": \"a\"}\n\n{\"text\": \n";
  std::ofstream(dir_ / "earlier.u32") << "earlier output";
  const std::string d = dir_.string();
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--model", d + "/missing", "--data", text.string(), "--out", d + "/t.u32"},
       "model directory '" + d + "/missing' does not exist"},
      {{"--model", d + "/no_tokenizer", "--data", text.string(), "--out", d + "/t.u32"},
       "model directory '" + d + "/no_tokenizer' has no tokenizer.json"},
      {{"--model", model.string(), "--data", d + "/missing.txt", "--out", d + "/t.u32"},
       "data file '" + d + "/missing.txt' does not exist"},
      {{"--model", model.string(), "--data", text.string(), "--format", "csv", "--out",
        d + "/t.u32"},
       "unknown --format 'csv' (expected text or jsonl)"},
      {{"--model", model.string(), "--data", d + "/missing_field.jsonl", "--format", "jsonl",
        "--out", d + "/t.u32"},
       "'" + d + "/missing_field.jsonl' line 2 has no string field 'text' (--field)"},
      {{"--model", model.string(), "--data", d + "/missing_field.jsonl", "--format", "jsonl",
        "--field", "", "--out", d + "/t.u32"},
       "--field must name the JSON field holding the text"},
      {{"--model", model.string(), "--data", d + "/not_json.jsonl", "--format", "jsonl", "--out",
        d + "/earlier.u32"},
       "'" + d + "/not_json.jsonl' line 3 is not JSON"},
      {{"--model", model.string(), "--data", text.string(), "--out", d + "/t.bin"},
       "--out '" + d + "/t.bin': unknown extension (expected .u16 or .u32, little-endian ids)"},
      {{"--model", model.string(), "--data", text.string(), "--out", d + "/nodir/t.u32"},
       "--out '" + d + "/nodir/t.u32': directory '" + d + "/nodir' does not exist"},
      {{"--model", model.string(), "--data", text.string(), "--sample-by", "sentence", "--out",
        d + "/t.u32"},
       "unknown --sample-by 'sentence' (expected line, paragraph or document)"},
  };
  const auto before = tree(dir_);
  for (const auto& c : cases) {
    const auto r = mdist(2, with({"tokenize"}, c.args));
    EXPECT_EQ(r.exit_code, 2) << describe(r);
    EXPECT_THAT(r.err, HasSubstr("[rank0]: mdist tokenize: error: " + c.message)) << r.err;
    EXPECT_EQ(error_lines(r.err), 1) << r.err;
    EXPECT_EQ(tree(dir_), before) << "a file was written or removed for: " << c.message;
  }
  EXPECT_EQ(read(dir_ / "earlier.u32"), "earlier output");
}

// A model directory with a tokenizer.json: train, eval and calibrate tokenize --data text with
// it (training on the text and on its `mdist tokenize` output is the same run), checkpoints
// carry the tokenizer files, generate encodes and decodes; without one the log says bytes.
TEST_F(MdistTokenizer, TextDataGoesThroughTheModelsTokenizer) {
  const auto model = tokenizer_model("llama2");
  const auto text = corpus(6);
  const auto expected = expected_ids(model, text);
  const auto tokens = dir_ / "corpus.u32";
  ASSERT_EQ(mdist(1, {"tokenize", "--model", model.string(), "--data", text.string(), "--out",
                      tokens.string()})
                .exit_code,
            0);
  std::vector<std::vector<nlohmann::json>> runs;
  for (const auto& data : {text, tokens}) {
    const auto run = dir_ / ("run-" + data.extension().string().substr(1));
    const auto r = mdist(2, train_args({"--model", model.string(), "--data", data.string(),
                                        "--steps", "3", "--out", run.string()}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_THAT(r.out, HasSubstr("mdist train: tokenizer: "));
    EXPECT_THAT(r.out, HasSubstr("all split: " + std::to_string(expected.size()) + " tokens)"));
    runs.push_back(metrics(run));
    const auto saved = run / "checkpoints" / "step-00000003";
    EXPECT_EQ(read(saved / "tokenizer.json"), read(model / "tokenizer.json"));
    EXPECT_EQ(read(saved / "tokenizer_config.json"), read(model / "tokenizer_config.json"));
  }
  EXPECT_THAT(read(dir_ / "run-txt" / "metrics.jsonl"), Not(HasSubstr("nan")));
  ASSERT_EQ(runs[0].size(), runs[1].size());
  for (std::size_t i = 0; i < runs[0].size(); ++i)
    EXPECT_EQ(runs[0][i]["loss"], runs[1][i]["loss"]);

  const auto saved = dir_ / "run-txt" / "checkpoints" / "step-00000003";
  auto r =
      mdist(1, {"eval", "--model", saved.string(), "--data", text.string(), "--seq-len", "32"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("mdist eval: tokenizer: "));
  EXPECT_THAT(r.out, HasSubstr("(text, tokenizer, all split: "));
  r = mdist(2, {"calibrate", "--model", saved.string(), "--data", text.string(), "--seq-len", "32",
                "--max-sequences", "2", "--out", (dir_ / "calibration.json").string()});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("mdist calibrate: tokenizer: "));
  r = mdist(2, {"generate", "--model", saved.string(), "--prompt", "The quick", "--greedy",
                "--max-new-tokens", "8"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("mdist generate: tokenizer: "));
  EXPECT_THAT(r.out, HasSubstr("----\n[rank0]: The quick"));

  r = mdist(1, {"eval", "--model", checkpoint("bytes").string(), "--seq-len", "32"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("mdist eval: tokenizer: none, text read as bytes"));
}

// A tokenizer whose ids do not fit the model's vocabulary: one line, exit code 2, no output.
TEST_F(MdistTokenizer, AVocabularyMismatchIsOneClearError) {
  const auto model = tokenizer_model("llama2", /*grow=*/false);  // vocab_size 256
  const auto text = corpus(1);
  const auto out = dir_ / "run";
  const auto r = mdist(
      2, train_args({"--model", model.string(), "--data", text.string(), "--out", out.string()}));
  expect_refused(r, "train", "data file '" + text.string() + "': token ", out);
  EXPECT_THAT(r.err, HasSubstr(", outside the model's vocabulary [0, 256)"));
}

// `mdist tokenize` streams its corpus (the mapping's pages released as it goes, ids written as
// each document is encoded): the peak RSS on a 64 MiB corpus stays within 50 MiB of that on a
// 4 KiB one. (64 MiB rather than 2 GiB keeps the test short; the benchmark bench/tokenize.sh
// measures 256 MiB.) Both on 2 ranks; the peaks are the ranks' VmHWM the command reports.
TEST_F(MdistTokenizer, PeakMemoryOfTokenizeDoesNotGrowWithTheCorpus) {
  const auto model = tokenizer_model("gpt2");
  const std::string text = read(fs::path(MDIST_TOKENIZER_FIXTURES) / "corpus.txt");
  std::map<std::string, double> peaks;
  for (const auto& [name, bytes] :
       {std::pair<std::string, std::size_t>{"small", 4096}, {"big", std::size_t{64} << 20}}) {
    const auto data = dir_ / (name + ".txt");
    {
      std::ofstream out(data, std::ios::binary);
      for (std::size_t written = 0; written < bytes; written += text.size()) out << text;
    }
    const auto r = mdist(2, {"tokenize", "--model", model.string(), "--data", data.string(),
                             "--out", (dir_ / (name + ".u32")).string()});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    const auto at = r.out.find("peak RSS MiB");
    ASSERT_NE(at, std::string::npos) << r.out;
    std::istringstream numbers(r.out.substr(at + 12));
    for (double mib = 0; numbers >> mib;) peaks[name] = std::max(peaks[name], mib);
    fs::remove(data);
    fs::remove(dir_ / (name + ".u32"));
  }
  std::cout << "peak RSS per rank: 4 KiB corpus " << peaks["small"] << " MiB, 64 MiB corpus "
            << peaks["big"] << " MiB\n";
  EXPECT_GT(peaks["small"], 0);
  EXPECT_LT(peaks["big"], peaks["small"] + 50);
}
