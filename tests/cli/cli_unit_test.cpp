// The libtorch-free parts of the `mdist` command: schedule, data, window order, loss picture,
// progress line (and the phase line).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <set>

#include "mdist/train/lr_schedule.h"
#include "src/cli/documents.h"
#include "src/cli/input_error.h"
#include "src/cli/loss_plot.h"
#include "src/cli/phase_progress.h"
#include "src/cli/progress.h"
#include "src/cli/run_dir.h"
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

std::vector<std::int32_t> ids_of(const mdist::cli::TokenStream& stream) {
  return stream.read(0, stream.size());
}

// A scratch file under the test's temporary directory, removed with the object.
class ScratchFile {
 public:
  ScratchFile(const std::string& name, const std::string& bytes)
      : path_(std::filesystem::temp_directory_path() /
              ("mdist-cli-unit-" + std::to_string(getpid()) + "-" + name)) {
    std::ofstream(path_, std::ios::binary) << bytes;
  }
  ~ScratchFile() { std::filesystem::remove(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

TEST(LrSchedule, WarmsUpLinearlyThenDecaysByCosineToTheFloor) {
  const mdist::train::LrSchedule s{
      .peak = 1.0, .warmup_steps = 10, .total_steps = 110, .min_ratio = 0.1};
  EXPECT_DOUBLE_EQ(s.at(1), 0.1);
  EXPECT_DOUBLE_EQ(s.at(5), 0.5);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(60), 0.55, 1e-12);  // half way through the decay: the mid point
  EXPECT_NEAR(s.at(110), 0.1, 1e-12);
  for (int step = 11; step < 110; ++step) EXPECT_GT(s.at(step), s.at(step + 1)) << step;
  const mdist::train::LrSchedule no_warmup{
      .peak = 2.0, .warmup_steps = 0, .total_steps = 4, .min_ratio = 0.0};
  EXPECT_NEAR(no_warmup.at(0), 2.0, 1e-12);
  EXPECT_NEAR(no_warmup.at(4), 0.0, 1e-12);
}

TEST(TokenData, TextIsOneTokenPerByteAndSplitsNinetyTen) {
  std::string text(100, 'a');
  text[0] = static_cast<char>(0xff);
  const auto all =
      mdist::cli::load_tokens_from_bytes(text, "t", DataFormat::text, DataSplit::all, 256);
  ASSERT_EQ(all.size(), 100);
  EXPECT_EQ(ids_of(all)[0], 255);
  EXPECT_EQ(ids_of(all)[1], 'a');
  EXPECT_EQ(
      mdist::cli::load_tokens_from_bytes(text, "t", DataFormat::text, DataSplit::train, 256).size(),
      90);
  EXPECT_EQ(
      mdist::cli::load_tokens_from_bytes(text, "t", DataFormat::text, DataSplit::eval, 256).size(),
      10);
  EXPECT_THAT(all.description, HasSubstr("100 tokens"));
}

TEST(TokenData, IdsAndBinaryFormats) {
  const auto ids = mdist::cli::load_tokens_from_bytes(" 1 2\n3\t40 ", "x.ids", DataFormat::ids,
                                                      DataSplit::all, 50);
  EXPECT_EQ(ids_of(ids), (std::vector<std::int32_t>{1, 2, 3, 40}));
  const std::string u16("\x01\x00\x02\x01", 4);
  EXPECT_EQ(ids_of(mdist::cli::load_tokens_from_bytes(u16, "x.u16", DataFormat::u16, DataSplit::all,
                                                      1000)),
            (std::vector<std::int32_t>{1, 258}));
  const std::string i32("\x05\x00\x00\x00", 4);
  EXPECT_EQ(
      ids_of(mdist::cli::load_tokens_from_bytes(i32, "x.i32", DataFormat::i32, DataSplit::all, 10)),
      (std::vector<std::int32_t>{5}));
  const std::string u32("\x05\x00\x01\x00\x07\x00\x00\x00", 8);
  EXPECT_EQ(ids_of(mdist::cli::load_tokens_from_bytes(u32, "x.u32", DataFormat::u32, DataSplit::all,
                                                      70000)),
            (std::vector<std::int32_t>{65541, 7}));
}

// The memory-mapped files give the ids the in-memory reading gives, for every binary format
// and for text, whole and split; the extension picks the format.
TEST(TokenData, MappedFilesReadAsTheBytesInMemory) {
  std::string bytes;
  for (int i = 0; i < 4000; ++i) bytes.push_back(static_cast<char>((i * 7 + i / 256) % 127));
  for (const auto& [ext, format] : {std::pair{".txt", DataFormat::text},
                                    {".u16", DataFormat::u16},
                                    {".bin", DataFormat::u16},
                                    {".u32", DataFormat::u32},
                                    {".i32", DataFormat::i32}}) {
    const ScratchFile file(std::string("mapped") + ext, bytes);
    for (const auto split : {DataSplit::all, DataSplit::train, DataSplit::eval}) {
      const auto memory = mdist::cli::load_tokens_from_bytes(bytes, file.path().string(), format,
                                                             split, std::int64_t{1} << 31);
      const auto mapped =
          mdist::cli::load_tokens(file.path(), DataFormat::automatic, split, std::int64_t{1} << 31);
      EXPECT_EQ(ids_of(mapped), ids_of(memory)) << ext;
      EXPECT_EQ(mapped.description, memory.description);
      // A window in the middle, as batches read it.
      std::vector<std::int64_t> window(5);
      mapped.copy(3, 5, window.data());
      EXPECT_EQ(window[4], ids_of(memory)[7]) << ext;
    }
  }
}

// The range check split in parts: only the part holding a bad id finds it, and it names the
// id's position in the file; a u32 id beyond int32 is named with its value.
TEST(TokenData, RangeCheckSplitAcrossPartsFindsTheBadIdInItsPart) {
  std::string bytes(2 * 1000, '\0');
  bytes[2 * 700] = static_cast<char>(0x2c);  // id 300 at token 700
  bytes[2 * 700 + 1] = 1;
  const ScratchFile file("check.u16", bytes);
  const std::string expected = "data file '" + file.path().string() +
                               "': token 700 has id 300, outside the model's vocabulary [0, 256)";
  for (int index = 0; index < 3; ++index) {
    const auto check = [&] {
      mdist::cli::load_tokens(file.path(), DataFormat::automatic, DataSplit::all, 256, {index, 3});
    };
    EXPECT_EQ(message_of(check), index == 2 ? expected : "(no InputError)") << index;
  }
  const ScratchFile big("big.u32", std::string("\x01\x00\x00\x00\xff\xff\xff\xff", 8));
  EXPECT_EQ(message_of([&] {
              mdist::cli::load_tokens(big.path(), DataFormat::automatic, DataSplit::all, 256);
            }),
            "data file '" + big.path().string() +
                "': token 1 has id 4294967295, outside the model's vocabulary [0, 256)");
  const ScratchFile odd("odd.u32", "abcdef");
  EXPECT_EQ(message_of([&] {
              mdist::cli::load_tokens(odd.path(), DataFormat::automatic, DataSplit::all, 256);
            }),
            "data file '" + odd.path().string() + "' (u32) has 6 bytes, not a multiple of 4");
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
            "unknown data format 'csv' (expected auto, text, ids, u16, u32 or i32)");
}

// Documents of every split: the same documents in the same order whatever the number of
// parts the file is cut into, each part starting at a document boundary.
std::vector<std::string> documents_in_parts(const std::filesystem::path& path,
                                            const mdist::cli::DocumentOptions& options, int parts) {
  const mdist::cli::MappedFile file(path, "data file");
  std::vector<std::string> docs;
  std::size_t previous_end = 0;
  for (int p = 0; p < parts; ++p) {
    const auto [begin, end] = mdist::cli::document_range(file, p, parts, options.sample_by);
    EXPECT_EQ(begin, previous_end);
    previous_end = end;
    mdist::cli::for_each_document(
        file, begin, end, options,
        [&](std::string_view doc, std::size_t) { docs.emplace_back(doc); });
  }
  EXPECT_EQ(previous_end, file.size());
  return docs;
}

TEST(Documents, LinesParagraphsAndJsonLinesAreTheSameWhateverTheParts) {
  const ScratchFile text("docs.txt", "first line\r\nsecond\n\n\nthird para\nstill third\n\nlast");
  mdist::cli::DocumentOptions lines;
  const std::vector<std::string> expected_lines = {"first line", "second", "third para",
                                                   "still third", "last"};
  mdist::cli::DocumentOptions paragraphs;
  paragraphs.sample_by = mdist::cli::SampleBy::paragraph;
  const std::vector<std::string> expected_paragraphs = {"first line\r\nsecond",
                                                        "third para\nstill third", "last"};
  mdist::cli::DocumentOptions whole;
  whole.sample_by = mdist::cli::SampleBy::document;
  for (int parts = 1; parts <= 9; ++parts) {
    EXPECT_EQ(documents_in_parts(text.path(), lines, parts), expected_lines) << parts;
    EXPECT_EQ(documents_in_parts(text.path(), paragraphs, parts), expected_paragraphs) << parts;
    EXPECT_EQ(documents_in_parts(text.path(), whole, parts).size(), 1u) << parts;
  }
  const ScratchFile jsonl(
      "docs.jsonl", "{\"text\": \"a\\nb\", \"id\": 1}\n\n{\"id\": 2, \"text\": \"\u00e9\"}\n");
  mdist::cli::DocumentOptions json;
  json.format = mdist::cli::DocumentFormat::jsonl;
  for (int parts = 1; parts <= 4; ++parts) {
    EXPECT_EQ(documents_in_parts(jsonl.path(), json, parts),
              (std::vector<std::string>{"a\nb", "\u00e9"}));
  }
  json.field = "body";
  EXPECT_EQ(message_of([&] { documents_in_parts(jsonl.path(), json, 1); }),
            "'" + jsonl.path().string() + "' line 1 has no string field 'body' (--field)");
  const ScratchFile broken("broken.jsonl", "{\"text\": \"ok\"}\n\n{\"text\": \n");
  json.field = "text";
  EXPECT_EQ(message_of([&] { documents_in_parts(broken.path(), json, 2); }),
            "'" + broken.path().string() + "' line 3 is not JSON");
}

TEST(Windows, CutsNonOverlappingWindowsAndRejectsShortData) {
  const auto stream =
      mdist::cli::load_tokens_from_bytes("abcdefghij", "t", DataFormat::text, DataSplit::all, 256);
  const mdist::cli::Windows windows(stream, 4, "train");
  EXPECT_EQ(windows.count(), 2);
  std::vector<std::int64_t> second(4);
  windows.copy(1, second.data());
  EXPECT_EQ(second, (std::vector<std::int64_t>{'e', 'f', 'g', 'h'}));
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
  // The order the 8-byte permutation of earlier versions drew (so runs resume alike).
  EXPECT_EQ(first, (std::vector<std::int64_t>{0, 3, 5, 2, 4, 1, 6}));
  EXPECT_EQ(second, (std::vector<std::int64_t>{3, 5, 4, 6, 1, 0, 2}));
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

TEST(PhaseProgress, LineShowsThePhaseItsCountAndElapsedTime) {
  mdist::cli::PhaseReport report{.command = "mdist quantize",
                                 .phase = "calibrating",
                                 .done = 12,
                                 .total = 64,
                                 .unit = "sequences",
                                 .elapsed_s = 3.7};
  EXPECT_EQ(mdist::cli::phase_line(report), "mdist quantize: calibrating 12/64 sequences | 0:03");
  report.done = 70;  // a last round past the total (padding forwards) shows the total
  report.elapsed_s = 3725;
  EXPECT_EQ(mdist::cli::phase_line(report),
            "mdist quantize: calibrating 64/64 sequences | 1:02:05");
  report.phase = "exporting";
  report.total = 0;  // nothing to count
  report.elapsed_s = 61;
  EXPECT_EQ(mdist::cli::phase_line(report), "mdist quantize: exporting | 1:01");
}

// What PhaseProgress writes to `terminal` or not, for two phases.
std::string phases_written(bool terminal) {
  std::FILE* file = std::tmpfile();
  {
    mdist::cli::PhaseProgress progress(file, "mdist quantize", terminal);
    progress.begin("calibrating", 4, "sequences");
    progress.update(4);
    progress.begin("exporting");
    progress.finish();
    progress.finish();  // a second finish draws nothing more
  }
  std::rewind(file);
  std::string text;
  for (int c = std::fgetc(file); c != EOF; c = std::fgetc(file)) text += static_cast<char>(c);
  std::fclose(file);
  // The elapsed times depend on the machine's speed: only their place is checked.
  return std::regex_replace(text, std::regex(R"( \| \d+:\d\d)"), " | T");
}

TEST(PhaseProgress, DrawsInPlaceOnATerminalAndNothingElsewhere) {
  EXPECT_EQ(phases_written(false), "");
  EXPECT_EQ(phases_written(true),
            "mdist quantize: calibrating 0/4 sequences | T\x1b[K\r"
            "mdist quantize: calibrating 4/4 sequences | T\x1b[K\r"
            "mdist quantize: calibrating 4/4 sequences | T\x1b[K\r\n"
            "mdist quantize: exporting | T\x1b[K\r"
            "mdist quantize: exporting | T\x1b[K\r\n");
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
