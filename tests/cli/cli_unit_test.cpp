// The libtorch-free parts of the `mdist` command: schedule, data, window order, loss picture,
// progress line.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "src/cli/input_error.h"
#include "src/cli/loss_plot.h"
#include "src/cli/progress.h"
#include "src/cli/run_dir.h"
#include "src/cli/schedule.h"
#include "src/cli/token_data.h"

namespace {

using mdist::cli::DataFormat;
using mdist::cli::DataSplit;
using mdist::cli::InputError;
using ::testing::HasSubstr;

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InputError& error) {
    return error.what();
  }
  return "(no InputError)";
}

TEST(LrSchedule, WarmsUpLinearlyThenDecaysByCosineToTheFloor) {
  const mdist::cli::LrSchedule s{
      .peak = 1.0, .warmup_steps = 10, .total_steps = 110, .min_ratio = 0.1};
  EXPECT_DOUBLE_EQ(s.at(1), 0.1);
  EXPECT_DOUBLE_EQ(s.at(5), 0.5);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(60), 0.55, 1e-12);  // half way through the decay: the mid point
  EXPECT_NEAR(s.at(110), 0.1, 1e-12);
  for (int step = 11; step < 110; ++step) EXPECT_GT(s.at(step), s.at(step + 1)) << step;
  const mdist::cli::LrSchedule no_warmup{
      .peak = 2.0, .warmup_steps = 0, .total_steps = 4, .min_ratio = 0.0};
  EXPECT_NEAR(no_warmup.at(0), 2.0, 1e-12);
  EXPECT_NEAR(no_warmup.at(4), 0.0, 1e-12);
}

TEST(TokenData, TextIsOneTokenPerByteAndSplitsNinetyTen) {
  std::string text(100, 'a');
  text[0] = static_cast<char>(0xff);
  const auto all =
      mdist::cli::load_tokens_from_bytes(text, "t", DataFormat::text, DataSplit::all, 256);
  ASSERT_EQ(all.tokens.size(), 100u);
  EXPECT_EQ(all.tokens[0], 255);
  EXPECT_EQ(all.tokens[1], 'a');
  EXPECT_EQ(mdist::cli::load_tokens_from_bytes(text, "t", DataFormat::text, DataSplit::train, 256)
                .tokens.size(),
            90u);
  EXPECT_EQ(mdist::cli::load_tokens_from_bytes(text, "t", DataFormat::text, DataSplit::eval, 256)
                .tokens.size(),
            10u);
  EXPECT_THAT(all.description, HasSubstr("100 tokens"));
}

TEST(TokenData, IdsAndBinaryFormats) {
  const auto ids = mdist::cli::load_tokens_from_bytes(" 1 2\n3\t40 ", "x.ids", DataFormat::ids,
                                                      DataSplit::all, 50);
  EXPECT_EQ(ids.tokens, (std::vector<std::int32_t>{1, 2, 3, 40}));
  const std::string u16("\x01\x00\x02\x01", 4);
  EXPECT_EQ(mdist::cli::load_tokens_from_bytes(u16, "x.u16", DataFormat::u16, DataSplit::all, 1000)
                .tokens,
            (std::vector<std::int32_t>{1, 258}));
  const std::string i32("\x05\x00\x00\x00", 4);
  EXPECT_EQ(
      mdist::cli::load_tokens_from_bytes(i32, "x.i32", DataFormat::i32, DataSplit::all, 10).tokens,
      (std::vector<std::int32_t>{5}));
}

TEST(TokenData, BadDataIsOneClearError) {
  EXPECT_EQ(message_of([] {
              mdist::cli::load_tokens_from_bytes("1 2 300", "x.ids", DataFormat::ids,
                                                 DataSplit::all, 256);
            }),
            "data file 'x.ids': token 2 has id 300, outside the model's vocabulary [0, 256)");
  EXPECT_EQ(message_of([] {
              mdist::cli::load_tokens_from_bytes("1 two", "x.ids", DataFormat::ids, DataSplit::all,
                                                 256);
            }),
            "data file 'x.ids': token 1 is 'two', not a non-negative integer id");
  EXPECT_EQ(message_of([] {
              mdist::cli::load_tokens_from_bytes("abc", "x.u16", DataFormat::u16, DataSplit::all,
                                                 256);
            }),
            "data file 'x.u16' (u16) has 3 bytes, not a multiple of 2");
  EXPECT_EQ(message_of([] {
              mdist::cli::load_tokens_from_bytes("Az", "t.txt", DataFormat::text, DataSplit::all,
                                                 100);
            }),
            "data file 't.txt': token 1 has id 122, outside the model's vocabulary [0, 100)");
  EXPECT_EQ(message_of([] {
              mdist::cli::load_tokens(std::filesystem::path("/nonexistent/data.txt"),
                                      DataFormat::automatic, DataSplit::all, 256);
            }),
            "data file '/nonexistent/data.txt' does not exist");
  EXPECT_EQ(message_of([] { mdist::cli::parse_data_format("csv"); }),
            "unknown data format 'csv' (expected auto, text, ids, u16 or i32)");
}

TEST(Windows, CutsNonOverlappingWindowsAndRejectsShortData) {
  const auto stream =
      mdist::cli::load_tokens_from_bytes("abcdefghij", "t", DataFormat::text, DataSplit::all, 256);
  const mdist::cli::Windows windows(stream, 4, "train");
  EXPECT_EQ(windows.count(), 2);
  EXPECT_EQ(windows.data(1)[0], 'e');
  EXPECT_EQ(message_of([&] { mdist::cli::Windows(stream, 11, "train"); }),
            "train: data t (text, all split: 10 tokens) is shorter than one sequence of 11 tokens "
            "(--seq-len)");
}

TEST(WindowOrder, IsAFreshPermutationPerEpochAndAPureFunctionOfSeedAndPosition) {
  mdist::cli::WindowOrder order(7, 42);
  std::vector<std::int64_t> first, second;
  for (int k = 0; k < 7; ++k) first.push_back(order.window_of(k));
  for (int k = 7; k < 14; ++k) second.push_back(order.window_of(k));
  EXPECT_EQ(std::set<std::int64_t>(first.begin(), first.end()).size(), 7u);
  EXPECT_EQ(std::set<std::int64_t>(second.begin(), second.end()).size(), 7u);
  EXPECT_NE(first, second);
  mdist::cli::WindowOrder again(7, 42);  // random access, as a resumed run does
  EXPECT_EQ(again.window_of(9), second[2]);
  EXPECT_EQ(again.window_of(3), first[3]);
  mdist::cli::WindowOrder other_seed(7, 43);
  std::vector<std::int64_t> other;
  for (int k = 0; k < 7; ++k) other.push_back(other_seed.window_of(k));
  EXPECT_NE(first, other);
}

TEST(LossPlot, DrawsThePointsAsAPolylineWithAnEscapedTitle) {
  const auto svg = mdist::cli::loss_curve_svg({{1, 5.5}, {2, 4.0}, {3, 3.25}}, "a <b> & c");
  EXPECT_THAT(svg, HasSubstr("<svg xmlns=\"http://www.w3.org/2000/svg\""));
  EXPECT_THAT(svg, HasSubstr("a &lt;b&gt; &amp; c"));
  EXPECT_THAT(svg, HasSubstr("<polyline"));
  EXPECT_THAT(svg, HasSubstr("</svg>"));
  // x from 70 (left margin) to 700 (right edge), loss 5.5 at the top of a [3.0, 5.5] axis.
  EXPECT_THAT(svg, HasSubstr("70.0,40.0 "));
  EXPECT_THAT(svg, HasSubstr("700.0,"));
}

TEST(Progress, LineShowsStepLossSpeedEtaAndEachRanksPeakMemory) {
  const mdist::cli::StepReport report{.step = 30,
                                      .total_steps = 120,
                                      .loss = 2.34567,
                                      .lr = 0.0029,
                                      .tokens_per_s = 5123.4,
                                      .elapsed_s = 15.0,
                                      .steps_done_here = 30,
                                      .peak_rss_mib = {812.2, 790.6}};
  EXPECT_EQ(mdist::cli::progress_line(report, false),
            "step 30/120 | loss 2.3457 | lr 2.90e-03 | 5123 tok/s | ETA 0:45 | peak MiB 812 791");
  EXPECT_EQ(mdist::cli::progress_line(report, true),
            "step 30/120 [######..................]  25% | loss 2.3457 | lr 2.90e-03 | 5123 tok/s "
            "| ETA 0:45 | peak MiB 812 791");
}

TEST(RunDir, TheLockKeepsASecondHolderOutAndIsFreedWithItsHolder) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("mdist-run-dir-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  mdist::cli::RunLock::check_free(dir);  // no directory: free, and nothing created
  EXPECT_FALSE(std::filesystem::exists(dir));
  {
    const mdist::cli::RunLock lock(dir);
    // Another process is kept out, with the holder's pid in the message.
    const pid_t child = fork();
    if (child == 0) {
      try {
        mdist::cli::RunLock::check_free(dir);
        _exit(1);
      } catch (const InputError& error) {
        _exit(std::string(error.what()).find("pid " + std::to_string(getppid())) !=
                      std::string::npos
                  ? 0
                  : 2);
      }
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  mdist::cli::RunLock::check_free(dir);  // released with its holder
  std::filesystem::remove_all(dir);
}

TEST(RunDir, AnEarlierRunIsItsMetricsOrCheckpoints) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("mdist-earlier-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "checkpoints");
  std::ofstream(dir / "notes.txt") << "mine";
  EXPECT_FALSE(mdist::cli::earlier_run(dir));
  std::filesystem::create_directories(dir / "checkpoints" / "step-00000002");
  EXPECT_EQ(mdist::cli::earlier_run(dir), "1 checkpoint");
  std::ofstream(dir / "metrics.jsonl") << "{}\n";
  EXPECT_EQ(mdist::cli::earlier_run(dir), "metrics.jsonl and 1 checkpoint");
  mdist::cli::remove_earlier_run(dir);
  EXPECT_FALSE(mdist::cli::earlier_run(dir));
  EXPECT_TRUE(std::filesystem::exists(dir / "notes.txt"));  // what a run did not write stays
  EXPECT_TRUE(mdist::cli::is_within(dir / "checkpoints" / ".." / "x", dir));
  EXPECT_TRUE(mdist::cli::is_within(dir, dir.string() + "/"));
  EXPECT_FALSE(mdist::cli::is_within(dir.string() + "-other", dir));
  EXPECT_FALSE(mdist::cli::is_within(dir / "..", dir));
  std::filesystem::remove_all(dir);
}

}  // namespace
