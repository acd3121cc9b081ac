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
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "tests/support/subprocess.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using mdist::testing::RunResult;
using ::testing::HasSubstr;

// Small enough for a 2-core machine: 10 steps of 4 sequences of 32 bytes.
const std::vector<std::string> kQuickTrain = {"--seq-len", "32", "--global-batch", "4",
                                              "--warmup",  "2",  "--log-every",    "1"};

class MdistCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("mdist-cli-test-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // mdistrun --nproc-per-node N mdist ARGS... (OMP_NUM_THREADS=1: the same arithmetic on
  // every rank count).
  static RunResult mdist(int ranks, std::vector<std::string> args) {
    std::vector<std::string> argv = {MDIST_LAUNCHER, "--nproc-per-node", std::to_string(ranks),
                                     MDIST_CLI};
    argv.insert(argv.end(), args.begin(), args.end());
    mdist::testing::RunOptions options;
    options.env["OMP_NUM_THREADS"] = "1";
    options.timeout = std::chrono::seconds(240);
    return mdist::testing::run(argv, options);
  }

  // mdist train, the quick flags, then `more`.
  static std::vector<std::string> train_args(const std::vector<std::string>& more) {
    return with(with({"train"}, kQuickTrain), more);
  }

  static std::vector<std::string> with(std::vector<std::string> args,
                                       const std::vector<std::string>& more) {
    args.insert(args.end(), more.begin(), more.end());
    return args;
  }

  static std::vector<nlohmann::json> metrics(const fs::path& run) {
    std::vector<nlohmann::json> lines;
    std::ifstream in(run / "metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
    return lines;
  }

  static std::string read(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
  }

  static std::string describe(const RunResult& r) {
    return "exit " + std::to_string(r.exit_code) + "\nstdout:\n" + r.out + "\nstderr:\n" + r.err;
  }

  fs::path dir_;
};

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

TEST_F(MdistCommand, AFreshRunReplacesAnEarlierRunsCheckpoints) {
  const auto run = dir_ / "run";
  auto r = mdist(1, train_args({"--steps", "6", "--save-every", "2", "--out", run.string()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  r = mdist(1, train_args({"--steps", "2", "--save-every", "2", "--out", run.string()}));
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
  for (const std::string command : {"train", "eval", "calibrate", "generate", "info"}) {
    const auto r = mdist::testing::run({MDIST_CLI, command, "--help"});
    EXPECT_EQ(r.exit_code, 0) << command;
    EXPECT_THAT(r.out, HasSubstr("Usage: mdist " + command)) << r.out;
  }
  const auto top = mdist::testing::run({MDIST_CLI, "--help"});
  EXPECT_EQ(top.exit_code, 0);
  for (const char* command : {"train", "eval", "calibrate", "generate", "info"}) {
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
  std::istringstream lines(r.err);
  int errors = 0;
  for (std::string line; std::getline(lines, line);)
    errors += line.find(": error: ") != std::string::npos;
  EXPECT_EQ(errors, 1) << r.err;
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
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  const auto log = (dir_ / "job.log").string();
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t launcher = 0;
  ASSERT_EQ(posix_spawn(&launcher, argv[0].c_str(), &actions, nullptr, cargv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);

  // Wait for the second checkpoint, then SIGKILL rank 1 (the launcher's child with RANK=1).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(180);
  while (!fs::exists(run / "checkpoints" / "step-00000004" / "trainer_state.json") &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  pid_t victim = 0;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string pid = entry.path().filename();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string field;
    for (int i = 0; i < 4 && stat >> field; ++i) {
    }
    if (field != std::to_string(launcher)) continue;
    const std::string environ_text = read(entry.path() / "environ");
    if (environ_text.find(std::string("RANK=1") + '\0') != std::string::npos &&
        environ_text.find(std::string("\0RANK=1\0", 8)) != std::string::npos) {
      victim = static_cast<pid_t>(std::stoi(pid));
    }
  }
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

}  // namespace
