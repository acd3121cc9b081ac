// `mdist train` and `mdist eval` with --format sft (prompt / completion JSON Lines) through the
// launcher: the same losses on 1 and 2 ranks and under --tp 2, packed (--packing) equal to
// padded, and every bad input as one line, exit code 2, nothing written. `mdist tokenize
// --format sft`: the same bytes on 1 and 2 ranks, and its output trains and evaluates to the
// JSON Lines file's losses bit for bit.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "tests/cli/mdist_command.h"

namespace {

namespace fs = std::filesystem;
using mdist::testing::MdistCommand;
using mdist::testing::RunResult;
using ::testing::HasSubstr;

int error_lines(const std::string& err) {
  std::istringstream lines(err);
  int errors = 0;
  for (std::string line; std::getline(lines, line);) {
    errors += line.find(": error: ") != std::string::npos;
  }
  return errors;
}

class MdistSft : public MdistCommand {
 protected:
  // A seeded Qwen3 with a sliding window of 6 on its second layer (shorter than the packed
  // rows), 1024 ids, with the llama2 tokenizer fixture (BOS added, EOS </s>).
  fs::path model() {
    const auto config_dir = dir_ / "config";
    fs::create_directories(config_dir);
    std::ofstream(config_dir / "config.json") << R"({
      "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 32,
      "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 1024,
      "max_position_embeddings": 64, "use_sliding_window": true, "sliding_window": 6,
      "max_window_layers": 1, "tie_word_embeddings": false})";
    const auto dir = dir_ / "model";
    const auto r =
        mdist::testing::run({MDIST_SAVE_FOR_TRANSFORMERS, config_dir.string(), dir.string()});
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    for (const char* file : {"tokenizer.json", "tokenizer_config.json"}) {
      fs::copy(fs::path(MDIST_TOKENIZER_FIXTURES) / "llama2" / file, dir / file,
               fs::copy_options::overwrite_existing);
    }
    return dir;
  }

  // Eight short question / answer examples under the default field names.
  fs::path examples() {
    const auto path = dir_ / "sft.jsonl";
    std::ofstream out(path);
    const std::vector<std::pair<std::string, std::string>> pairs = {
        {"Q: 2+2?\nA:", " 4"},         {"Q: capital of France?\nA:", " Paris"},
        {"Translate: cat", " chat"},   {"Q: colour of the sky?\nA:", " blue, mostly"},
        {"Say hi", " hi there"},       {"Q: 3*3?\nA:", " 9"},
        {"Name a fruit", " an apple"}, {"Q: opposite of up?\nA:", " down"}};
    for (const auto& [prompt, completion] : pairs) {
      out << nlohmann::json{{"prompt", prompt}, {"completion", completion}}.dump() << "\n";
    }
    return path;
  }

  // The rows the log reports ("packed into K rows" / "padded: K rows").
  static int rows_of(const RunResult& r) {
    std::smatch match;
    const std::regex rows("(packed into|padded:) ([0-9]+) rows");
    EXPECT_TRUE(std::regex_search(r.out, match, rows)) << r.out;
    return match.empty() ? 0 : std::stoi(match[2]);
  }

  static double eval_loss(const RunResult& r) {
    std::smatch match;
    const std::regex loss("loss ([0-9.]+) nats/token");
    EXPECT_TRUE(std::regex_search(r.out, match, loss)) << r.out;
    return match.empty() ? NAN : std::stod(match[1]);
  }

  void expect_refused(const RunResult& r, const std::string& command, const std::string& message,
                      const fs::path& out) {
    EXPECT_EQ(r.exit_code, 2) << describe(r);
    EXPECT_THAT(r.err, HasSubstr("[rank0]: mdist " + command + ": error: " + message)) << r.err;
    EXPECT_EQ(error_lines(r.err), 1) << r.err;
    EXPECT_FALSE(fs::exists(out)) << "output left behind: " << out;
  }
};

// The same SFT run on 1 rank, 2 ranks and --tp 2 gives the same losses (1e-6); packed rows
// give the padded rows' loss in eval and in the first step (the same examples, the same
// completion tokens); the per-token mean is over completion tokens only.
TEST_F(MdistSft, TrainIsTheSameOnEveryLayoutAndPackedEqualsPadded) {
  const auto dir = model();
  const auto data = examples();
  const std::vector<std::string> common = {"--model",  dir.string(), "--data",    data.string(),
                                           "--format", "sft",        "--seq-len", "48"};
  auto r = mdist(1, with(with({"eval"}, common), {}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(rows_of(r), 8);
  const double padded_eval = eval_loss(r);
  // The loss is over the completion tokens (with EOS) alone.
  std::smatch completion, predicted;
  ASSERT_TRUE(std::regex_search(r.out, completion, std::regex("([0-9]+) completion tokens")));
  ASSERT_TRUE(std::regex_search(r.out, predicted, std::regex("([0-9]+) tokens predicted")));
  EXPECT_EQ(completion[1], predicted[1]);
  r = mdist(2, with(with({"eval"}, common), {"--packing", "--batch-size", "1"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const int packed_rows = rows_of(r);
  EXPECT_LT(packed_rows, 8);
  EXPECT_NEAR(eval_loss(r), padded_eval, 1e-5);  // the log prints 6 decimals

  struct Layout {
    std::string name;
    int ranks;
    std::vector<std::string> flags;
  };
  const std::vector<Layout> layouts = {{"np1", 1, {}}, {"np2", 2, {}}, {"tp2", 2, {"--tp", "2"}}};
  std::map<std::string, std::vector<nlohmann::json>> runs;
  for (const bool packing : {false, true}) {
    for (const auto& layout : layouts) {
      const int rows = packing ? packed_rows : 8;
      if (layout.name == "np2" && rows % 2 != 0) continue;
      const std::string name = layout.name + (packing ? "-packed" : "-padded");
      std::vector<std::string> args =
          with(with({"train"}, common),
               {"--global-batch", std::to_string(rows), "--steps", "3", "--warmup", "1",
                "--log-every", "1", "--out", (dir_ / name).string()});
      if (packing) args.push_back("--packing");
      args = with(args, layout.flags);
      r = mdist(layout.ranks, args);
      ASSERT_EQ(r.exit_code, 0) << describe(r);
      EXPECT_THAT(r.out, HasSubstr(packing ? "packed into" : "padded: 8 rows"));
      runs[name] = metrics(dir_ / name);
      ASSERT_EQ(runs[name].size(), 3u) << name;
    }
  }
  for (const auto& [name, steps] : runs) {
    const auto& reference =
        name.ends_with("packed") ? runs.at("np1-packed") : runs.at("np1-padded");
    for (std::size_t i = 0; i < steps.size(); ++i) {
      EXPECT_NEAR(steps[i]["loss"].get<double>(), reference[i]["loss"].get<double>(), 1e-6)
          << name << " step " << i + 1;
    }
  }
  // Step 1 sees every example either way, on the same weights: the same mean up to the order
  // of fp32 sums (1e-6 relative: a few ulps of a loss of about 7, this random model's).
  const double padded_first = runs.at("np1-padded")[0]["loss"].get<double>();
  EXPECT_NEAR(runs.at("np1-packed")[0]["loss"].get<double>(), padded_first, 1e-6 * padded_first);
  EXPECT_TRUE(runs.contains("np2-packed")) << packed_rows << " packed rows: not on 2 ranks";
  EXPECT_NEAR(runs.at("np1-padded")[0]["loss"].get<double>(), padded_eval, 1e-5);
}

// Bad SFT input, in train and eval: one line from rank 0, exit code 2, nothing written.
TEST_F(MdistSft, BadInputIsOneLineAndWritesNothing) {
  const auto dir = model();
  const std::string d = dir_.string();
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
    return d + "/" + name;
  };
  const std::string good = R"({"prompt": "Q", "completion": " A"})";
  const auto not_json = write("not_json.jsonl", good + "\n{\"prompt\": \n");
  const auto not_object = write("not_object.jsonl", good + "\n\n[1, 2]\n");
  const auto no_completion = write("no_completion.jsonl", R"({"prompt": "Q"})"
                                                          "\n");
  const auto empty = write("empty.jsonl", good + "\n" + good + "\n" +
                                              R"({"prompt": "Q", "completion": ""})"
                                              "\n");
  const auto long_example =
      write("long.jsonl",
            good + "\n" +
                R"({"prompt": "a long prompt of many words", "completion": " and more"})" + "\n");
  const auto blank = write("blank.jsonl", "\n  \n");
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--data", not_json, "--format", "sft"},
       "data file '" + not_json + "' line 2 is not a JSON object"},
      {{"--data", not_object, "--format", "sft"},
       "data file '" + not_object + "' line 3 is not a JSON object"},
      {{"--data", no_completion, "--format", "sft"},
       "data file '" + no_completion +
           "' line 1 has no string field 'completion' (--completion-field)"},
      {{"--data", no_completion, "--format", "sft", "--prompt-field", "question"},
       "data file '" + no_completion + "' line 1 has no string field 'question' (--prompt-field)"},
      {{"--data", empty, "--format", "sft"},
       "data file '" + empty + "' line 3 has an empty 'completion'"},
      {{"--data", long_example, "--format", "sft", "--seq-len", "6"},
       "data file '" + long_example + "' line 2: its example has "},
      {{"--data", blank, "--format", "sft"}, "data file '" + blank + "' holds no example"},
      {{"--data", d + "/missing.jsonl", "--format", "sft"},
       "data file '" + d + "/missing.jsonl' does not exist"},
      {{"--data", empty, "--format", "chat"}, "unknown --format 'chat' (expected lm or sft)"},
      {{"--format", "sft"}, "--format sft needs --data FILE.jsonl"},
      {{"--data", empty, "--packing"}, "--packing needs --format sft"},
      {{"--data", empty, "--format", "sft", "--split", "train"},
       "--split train does not apply to --format sft (held-out examples: --eval-data)"},
  };
  const auto out = dir_ / "out";
  const auto before = tree(dir_);
  for (const auto& c : cases) {
    for (const std::string command : {"train", "eval"}) {
      std::vector<std::string> args = {command, "--model", dir.string(), "--seq-len", "32"};
      if (command == "train") args = with(args, {"--global-batch", "2", "--out", out.string()});
      if (command == "eval") args = with(args, {"--out", (out / "eval.json").string()});
      const auto r = mdist(2, with(args, c.args));
      expect_refused(r, command, c.message, out);
      EXPECT_EQ(tree(dir_), before) << "a file was written or removed for: " << c.message;
    }
  }
  // A mixture of experts is not packed (checked before its tokenizer: this one has none).
  const auto moe_config = dir_ / "moe-config";
  fs::create_directories(moe_config);
  std::ofstream(moe_config / "config.json") << R"({
      "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 32,
      "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 256, "num_experts": 4,
      "num_experts_per_tok": 2, "moe_intermediate_size": 16})";
  const auto moe = dir_ / "moe";
  ASSERT_EQ(mdist::testing::run({MDIST_SAVE_FOR_TRANSFORMERS, moe_config.string(), moe.string()})
                .exit_code,
            0);
  expect_refused(
      mdist(2, {"train", "--model", moe.string(), "--data", empty, "--format", "sft", "--packing",
                "--seq-len", "32", "--global-batch", "2", "--out", out.string()}),
      "train", "--packing is not supported for a mixture of experts", out);

  // A model without a tokenizer cannot read prompts and completions.
  const auto bytes_model = dir_ / "bytes-model";
  fs::copy(dir, bytes_model, fs::copy_options::recursive);
  fs::remove(bytes_model / "tokenizer.json");
  fs::remove(bytes_model / "tokenizer_config.json");
  expect_refused(mdist(1, {"eval", "--model", bytes_model.string(), "--data", empty, "--format",
                           "sft", "--seq-len", "32", "--out", (out / "eval.json").string()}),
                 "eval", "--format sft needs the model's tokenizer", out);
}

// The tokenized SFT pair (ids + loss mask) of `mdist tokenize --format sft`: the same bytes on 1
// and 2 ranks; one mask byte a token marking the examples and their completion tokens; and
// train / eval on it give the JSON Lines file's losses bit for bit, padded and packed, on 1 and
// 2 ranks.
TEST_F(MdistSft, TokenizedFileGivesTheJsonLinesLosses) {
  const auto dir = model();
  const auto data = examples();
  const auto one = dir_ / "one.u32";
  const auto two = dir_ / "two.u32";
  for (const auto& [ranks, out] : {std::pair{1, one}, std::pair{2, two}}) {
    const auto r = mdist(ranks, {"tokenize", "--model", dir.string(), "--data", data.string(),
                                 "--out", out.string(), "--format", "sft"});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_THAT(r.out, HasSubstr("from 8 examples")) << r.out;
  }
  const std::string ids = read(one);
  const std::string mask = read(fs::path(one.string() + ".mask"));
  EXPECT_EQ(read(two), ids);
  EXPECT_EQ(read(fs::path(two.string() + ".mask")), mask);
  ASSERT_EQ(mask.size() * 4, ids.size());
  int starts = 0, completion = 0;
  for (const char c : mask) {
    ASSERT_LE(static_cast<unsigned char>(c), 3);
    starts += (c & 2) != 0;
    completion += (c & 1) != 0;
  }
  EXPECT_EQ(starts, 8);

  const std::vector<std::string> common = {"--model", dir.string(), "--format",
                                           "sft",     "--seq-len",  "48"};
  for (const bool packing : {false, true}) {
    std::vector<std::string> flags = common;
    if (packing) flags.push_back("--packing");
    // eval: the same loss, the same completion tokens.
    auto r = mdist(1, with(with({"eval", "--data", data.string()}, flags), {}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    const double jsonl_eval = eval_loss(r);
    const int rows = rows_of(r);
    EXPECT_THAT(r.out, HasSubstr(std::to_string(completion) + " completion tokens"));
    for (const int ranks : {1, 2}) {
      r = mdist(ranks, with(with({"eval", "--data", one.string()}, flags), {}));
      ASSERT_EQ(r.exit_code, 0) << describe(r);
      EXPECT_EQ(eval_loss(r), jsonl_eval) << ranks << " ranks, packing " << packing;
      EXPECT_EQ(rows_of(r), rows);
      EXPECT_THAT(r.out, HasSubstr(std::to_string(completion) + " completion tokens"));
    }
    // train: the same losses at every step (an even batch, so that 2 ranks can split it).
    const std::string batch = std::to_string(rows % 2 == 0 ? rows : rows - 1);
    const auto train = [&](int ranks, const fs::path& file, const std::string& name) {
      const auto run = dir_ / name;
      const auto result = mdist(ranks, with(with({"train", "--data", file.string()}, flags),
                                            {"--global-batch", batch, "--steps", "3", "--warmup",
                                             "1", "--log-every", "1", "--out", run.string()}));
      EXPECT_EQ(result.exit_code, 0) << describe(result);
      return metrics(run);
    };
    const std::string tag = packing ? "-packed" : "-padded";
    const auto reference = train(1, data, "jsonl" + tag);
    ASSERT_EQ(reference.size(), 3u);
    for (const int ranks : {1, 2}) {
      const auto steps = train(ranks, one, "tokenized-np" + std::to_string(ranks) + tag);
      ASSERT_EQ(steps.size(), 3u);
      for (std::size_t i = 0; i < steps.size(); ++i) {
        if (ranks == 1) {  // the same batches in the same order: bit for bit
          EXPECT_EQ(steps[i]["loss"].get<double>(), reference[i]["loss"].get<double>())
              << tag << " step " << i + 1;
        } else {  // 2 ranks sum in another order
          EXPECT_NEAR(steps[i]["loss"].get<double>(), reference[i]["loss"].get<double>(), 1e-6)
              << tag << " step " << i + 1;
        }
      }
    }
  }
}

// Bad input to `mdist tokenize --format sft`, as train --format sft words it (the line named,
// also when it falls in the second rank's part), and a bad tokenized pair when training or
// evaluating on it: one line from rank 0, exit code 2, nothing written.
TEST_F(MdistSft, TokenizeBadInputAndBadTokenizedFilesAreOneLine) {
  const auto dir = model();
  const std::string d = dir_.string();
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary) << text;
    return d + "/" + name;
  };
  std::string good;
  for (int i = 0; i < 8; ++i)
    good += R"({"prompt": "Q", "completion": " A"})"
            "\n";
  const auto not_object = write("not_object.jsonl", good + "[1, 2]\n");
  const auto no_completion = write("no_completion.jsonl", good + R"({"prompt": "Q"})"
                                                                 "\n");
  const auto empty = write("empty.jsonl", good + R"({"prompt": "Q", "completion": ""})"
                                                 "\n");
  const auto blank = write("blank.jsonl", "\n  \n");
  const auto jsonl = write("good.jsonl", good);
  const auto out = dir_ / "out.u32";
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--data", not_object, "--format", "sft"},
       "data file '" + not_object + "' line 9 is not a JSON object"},
      {{"--data", no_completion, "--format", "sft"},
       "data file '" + no_completion +
           "' line 9 has no string field 'completion' (--completion-field)"},
      {{"--data", no_completion, "--format", "sft", "--prompt-field", "question"},
       "data file '" + no_completion + "' line 1 has no string field 'question' (--prompt-field)"},
      {{"--data", empty, "--format", "sft"},
       "data file '" + empty + "' line 9 has an empty 'completion'"},
      {{"--data", blank, "--format", "sft"}, "data file '" + blank + "' holds no example"},
      {{"--data", jsonl, "--format", "sft", "--field", "q"},
       "--field is for --format jsonl; --format sft reads --prompt-field and --completion-field"},
      {{"--data", jsonl, "--format", "jsonl", "--prompt-field", "q"},
       "--prompt-field and --completion-field need --format sft"},
  };
  auto before = tree(dir_);
  for (const auto& c : cases) {
    for (const int ranks : {1, 2}) {
      const auto r =
          mdist(ranks, with({"tokenize", "--model", dir.string(), "--out", out.string()}, c.args));
      expect_refused(r, "tokenize", c.message, out);
      EXPECT_FALSE(fs::exists(out.string() + ".mask"));
      EXPECT_EQ(tree(dir_), before) << "a file was written or removed for: " << c.message;
    }
  }

  // A good pair, then damaged copies of it.
  ASSERT_EQ(mdist(1, {"tokenize", "--model", dir.string(), "--data", jsonl, "--out", out.string(),
                      "--format", "sft"})
                .exit_code,
            0);
  const std::string ids = read(out);
  const std::string mask = read(fs::path(out.string() + ".mask"));
  const auto pair = [&](const std::string& name, const std::string& i, const std::string& m) {
    const std::string path = write(name + ".u32", i);
    if (!m.empty()) write(name + ".u32.mask", m);
    return path;
  };
  std::string bad_byte = mask;
  bad_byte[3] = 7;
  std::string no_start = mask;
  no_start[0] = 0;
  const auto short_mask = pair("short_mask", ids, mask.substr(0, mask.size() - 1));
  const auto short_ids = pair("short_ids", ids.substr(0, ids.size() - 4), mask);
  const auto cut_ids = pair("cut_ids", ids.substr(0, ids.size() - 1), mask);
  const auto no_mask = pair("no_mask", ids, "");
  const auto bad_mask = pair("bad_mask", ids, bad_byte);
  const auto unstarted = pair("unstarted", ids, no_start);
  const std::string n = std::to_string(mask.size());
  const std::vector<Case> bad_pairs = {
      {{"--data", short_mask},
       "loss-mask file '" + short_mask + ".mask' has " + std::to_string(mask.size() - 1) +
           " bytes but data file '" + short_mask + "' has " + n +
           " tokens (one mask byte a token): a truncated or mismatched pair"},
      {{"--data", short_ids},
       "loss-mask file '" + short_ids + ".mask' has " + n + " bytes but data file '" + short_ids +
           "' has " + std::to_string(mask.size() - 1) + " tokens"},
      {{"--data", cut_ids},
       "data file '" + cut_ids + "' (u32) has " + std::to_string(ids.size() - 1) +
           " bytes, not a multiple of 4"},
      {{"--data", no_mask}, "loss-mask file '" + no_mask + ".mask' does not exist"},
      {{"--data", bad_mask},
       "loss-mask file '" + bad_mask + ".mask': byte 3 is 7, not a loss-mask byte (0 to 3)"},
      {{"--data", unstarted},
       "loss-mask file '" + unstarted + ".mask' does not start an example at its first byte"},
      {{"--data", out.string(), "--seq-len", "3"},
       "data file '" + out.string() + "': example 1 (tokens 0 to "},
  };
  const auto run_dir = dir_ / "run";
  before = tree(dir_);
  for (const auto& c : bad_pairs) {
    for (const std::string command : {"train", "eval"}) {
      std::vector<std::string> args = {command, "--model", dir.string(), "--format", "sft"};
      if (command == "train") args = with(args, {"--global-batch", "2", "--out", run_dir.string()});
      if (command == "eval") args = with(args, {"--out", (run_dir / "eval.json").string()});
      if (std::find(c.args.begin(), c.args.end(), "--seq-len") == c.args.end()) {
        args = with(args, {"--seq-len", "32"});
      }
      const auto r = mdist(2, with(args, c.args));
      expect_refused(r, command, c.message, run_dir);
      EXPECT_EQ(tree(dir_), before) << "a file was written or removed for: " << c.message;
    }
  }
}

}  // namespace
