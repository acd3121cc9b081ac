// Unit tests of mdistrun's building blocks; the end-to-end behaviour is in launcher_test.cpp.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <variant>
#include <vector>

#include "options.h"
#include "output_prefixer.h"
#include "rank_environment.h"
#include "rank_process.h"
#include "unique_fd.h"

namespace mdist::launcher {
namespace {

ParseResult parse(const std::vector<std::string>& args) { return parse_command_line(args); }

LaunchOptions parse_ok(const std::vector<std::string>& args) {
  const ParseResult result = parse(args);
  if (const auto* early = std::get_if<EarlyExit>(&result)) {
    ADD_FAILURE() << "unexpected early exit: " << early->message;
    return {};
  }
  return std::get<LaunchOptions>(result);
}

std::string parse_error(const std::vector<std::string>& args) {
  const ParseResult result = parse(args);
  const auto* early = std::get_if<EarlyExit>(&result);
  if (early == nullptr) {
    ADD_FAILURE() << "expected an error";
    return {};
  }
  EXPECT_NE(early->exit_code, 0);
  EXPECT_TRUE(early->to_stderr);
  return early->message;
}

TEST(LauncherOptions, Defaults) {
  const LaunchOptions o = parse_ok({"prog"});
  EXPECT_EQ(o.nproc_per_node, 1);
  EXPECT_EQ(o.nnodes, 1);
  EXPECT_EQ(o.node_rank, 0);
  EXPECT_EQ(o.master_addr, "127.0.0.1");
  EXPECT_FALSE(o.master_addr_given);
  EXPECT_EQ(o.master_port, 0);
  EXPECT_FALSE(o.master_port_given);
  EXPECT_DOUBLE_EQ(o.kill_timeout_s, 3.0);
  EXPECT_EQ(o.command, std::vector<std::string>{"prog"});
}

TEST(LauncherOptions, BothSpellingsAndEqualsForm) {
  const LaunchOptions o =
      parse_ok({"--nproc_per_node=4", "--nnodes", "3", "--node_rank", "2", "--master_addr",
                "10.0.0.1", "--master_port", "29500", "--kill-timeout", "0.5", "prog", "a"});
  EXPECT_EQ(o.nproc_per_node, 4);
  EXPECT_EQ(o.nnodes, 3);
  EXPECT_EQ(o.node_rank, 2);
  EXPECT_EQ(o.master_addr, "10.0.0.1");
  EXPECT_TRUE(o.master_addr_given);
  EXPECT_EQ(o.master_port, 29500);
  EXPECT_DOUBLE_EQ(o.kill_timeout_s, 0.5);
  EXPECT_EQ(o.command, (std::vector<std::string>{"prog", "a"}));
}

TEST(LauncherOptions, LastOccurrenceWinsLikeArgparse) {
  EXPECT_EQ(parse_ok({"--nproc-per-node", "2", "--nproc-per-node", "5", "p"}).nproc_per_node, 5);
}

TEST(LauncherOptions, EverythingFromProgramOnIsUntouched) {
  const LaunchOptions o = parse_ok(
      {"--standalone", "--no-python", "prog", "--nproc-per-node", "9", "-h", "--", "--bogus"});
  EXPECT_EQ(o.nproc_per_node, 1);
  EXPECT_EQ(o.command,
            (std::vector<std::string>{"prog", "--nproc-per-node", "9", "-h", "--", "--bogus"}));
  EXPECT_EQ(parse_ok({"--", "-dash-prog", "x"}).command,
            (std::vector<std::string>{"-dash-prog", "x"}));
}

TEST(LauncherOptions, HelpGoesToStdoutWithExitZero) {
  const ParseResult result = parse({"-h"});
  const auto& early = std::get<EarlyExit>(result);
  EXPECT_EQ(early.exit_code, 0);
  EXPECT_FALSE(early.to_stderr);
  EXPECT_NE(early.message.find("PROGRAM [ARGS...]"), std::string::npos);
}

TEST(LauncherOptions, ErrorsAreSingleLines) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {},
           {"--nproc-per-node", "0", "p"},
           {"--nproc-per-node", "1x", "p"},
           {"--nproc-per-node", "99999999999", "p"},
           {"--nnodes", "-3", "p"},
           {"--node-rank", "1", "p"},
           {"--master-port", "65536", "p"},
           {"--master-port", "", "p"},
           {"--kill-timeout", "-1", "p"},
           {"--kill-timeout", "inf", "p"},
           {"--kill-timeout", "nan", "p"},
           {"--kill-timeout", "1e9", "p"},
           {"--master-addr", "", "p"},
           {"--nnodes", "2", "--master-port", "0", "p"},
           {"--unknown", "p"},
       }) {
    const std::string message = parse_error(args);
    EXPECT_TRUE(message.starts_with("mdistrun: ")) << message;
    EXPECT_EQ(std::count(message.begin(), message.end(), '\n'), 1) << message;
  }
}

TEST(LauncherOptions, RejectsAWorldSizeThatOverflowsInt) {
  EXPECT_NE(parse_error({"--nnodes", "65536", "--node-rank", "0", "--master-port", "1",
                         "--nproc-per-node", "65536", "p"})
                .find("too large"),
            std::string::npos);
}

TEST(LauncherRankEnvironment, ReplacesContractVariablesAndKeepsTheRest) {
  const JobLayout layout{.nproc_per_node = 4,
                         .nnodes = 2,
                         .node_rank = 1,
                         .master_addr = "10.0.0.1",
                         .master_port = 29500,
                         .run_id = "abc",
                         .omp_num_threads = "1"};
  const std::vector<std::string> base = {"PATH=/bin", "RANK=99", "MDIST_STORE_LISTEN_FD=7",
                                         "OMP_NUM_THREADS=8", "HOME=/root"};
  const std::vector<std::string> env = build_rank_environment(layout, 2, base, std::nullopt);
  const auto has = [&](const std::string& entry) {
    return std::ranges::find(env, entry) != env.end();
  };
  EXPECT_TRUE(has("PATH=/bin"));
  EXPECT_TRUE(has("HOME=/root"));
  EXPECT_TRUE(has("RANK=6"));
  EXPECT_FALSE(has("RANK=99"));
  EXPECT_TRUE(has("LOCAL_RANK=2"));
  EXPECT_TRUE(has("WORLD_SIZE=8"));
  EXPECT_TRUE(has("LOCAL_WORLD_SIZE=4"));
  EXPECT_TRUE(has("GROUP_RANK=1"));
  EXPECT_TRUE(has("GROUP_WORLD_SIZE=2"));
  EXPECT_TRUE(has("ROLE_RANK=6"));
  EXPECT_TRUE(has("ROLE_WORLD_SIZE=8"));
  EXPECT_TRUE(has("ROLE_NAME=default"));
  EXPECT_TRUE(has("MASTER_ADDR=10.0.0.1"));
  EXPECT_TRUE(has("MASTER_PORT=29500"));
  EXPECT_TRUE(has("TORCHELASTIC_RESTART_COUNT=0"));
  EXPECT_TRUE(has("TORCHELASTIC_MAX_RESTARTS=0"));
  EXPECT_TRUE(has("TORCHELASTIC_RUN_ID=abc"));
  EXPECT_TRUE(has("OMP_NUM_THREADS=1"));
  EXPECT_FALSE(has("OMP_NUM_THREADS=8"));
  EXPECT_TRUE(has("MDIST_STDOUT_IS_TTY=0"));  // the layout's default: not a terminal
  EXPECT_TRUE(std::ranges::none_of(
      env, [](const std::string& e) { return e.starts_with("MDIST_STORE_LISTEN_FD="); }));
  // No variable appears twice.
  std::vector<std::string> keys;
  for (const std::string& e : env) keys.push_back(e.substr(0, e.find('=')));
  std::ranges::sort(keys);
  EXPECT_EQ(std::ranges::adjacent_find(keys), keys.end());
}

TEST(LauncherRankEnvironment, ListenFdOnlyWhenGivenAndOmpUntouchedWhenNotForced) {
  const JobLayout layout{.nproc_per_node = 1,
                         .nnodes = 1,
                         .node_rank = 0,
                         .master_addr = "127.0.0.1",
                         .master_port = 1234,
                         .run_id = "x",
                         .omp_num_threads = std::nullopt};
  const std::vector<std::string> env =
      build_rank_environment(layout, 0, std::vector<std::string>{"OMP_NUM_THREADS=8"}, 5);
  EXPECT_NE(std::ranges::find(env, "MDIST_STORE_LISTEN_FD=5"), env.end());
  EXPECT_NE(std::ranges::find(env, "OMP_NUM_THREADS=8"), env.end());
}

TEST(LauncherRankEnvironment, TellsRanksWhetherTheLaunchersStdoutIsATerminal) {
  JobLayout layout{.master_addr = "127.0.0.1",
                   .master_port = 1234,
                   .run_id = "x",
                   .omp_num_threads = std::nullopt,
                   .stdout_is_tty = false};
  layout.stdout_is_tty = true;
  const std::vector<std::string> base = {"MDIST_STDOUT_IS_TTY=0"};  // inherited, stale
  const auto env = build_rank_environment(layout, 0, base, std::nullopt);
  EXPECT_NE(std::ranges::find(env, "MDIST_STDOUT_IS_TTY=1"), env.end());
  EXPECT_EQ(std::ranges::find(env, "MDIST_STDOUT_IS_TTY=0"), env.end());
}

TEST(LauncherOutputPrefixer, PrefixesCompleteLinesAcrossChunks) {
  OutputPrefixer prefixer(3);
  std::string out;
  prefixer.feed("hel", out);
  EXPECT_EQ(out, "");
  prefixer.feed("lo\nwor", out);
  EXPECT_EQ(out, "[rank3]: hello\n");
  prefixer.feed("ld\n\nlast", out);
  EXPECT_EQ(out, "[rank3]: hello\n[rank3]: world\n[rank3]: \n");
  prefixer.finish(out);
  EXPECT_EQ(out, "[rank3]: hello\n[rank3]: world\n[rank3]: \n[rank3]: last\n");
  prefixer.finish(out);  // nothing left
  EXPECT_EQ(out, "[rank3]: hello\n[rank3]: world\n[rank3]: \n[rank3]: last\n");
}

TEST(LauncherOutputPrefixer, EmitsOverlongLinesInsteadOfBufferingForever) {
  OutputPrefixer prefixer(0, /*max_pending=*/4);
  std::string out;
  prefixer.feed("abcdef", out);
  EXPECT_EQ(out, "[rank0]: abcdef\n");
  prefixer.feed("x\n", out);
  EXPECT_EQ(out, "[rank0]: abcdef\n[rank0]: x\n");
}

TEST(LauncherOutputPrefixer, PassesCarriageReturnSegmentsOnForRedrawnLines) {
  OutputPrefixer prefixer(0);
  std::string out;
  prefixer.feed("step 1\r", out);
  EXPECT_EQ(out, "[rank0]: step 1\r");
  prefixer.feed("step 2\rstep 3", out);
  EXPECT_EQ(out, "[rank0]: step 1\r[rank0]: step 2\r");
  prefixer.feed("\r\n", out);  // the bar's last redraw, then its line ends: no empty line
  EXPECT_EQ(out, "[rank0]: step 1\r[rank0]: step 2\r[rank0]: step 3\r\n");
  prefixer.feed("a\r\nb\n\n", out);  // CRLF; an empty line after a plain one stays a line
  EXPECT_EQ(out,
            "[rank0]: step 1\r[rank0]: step 2\r[rank0]: step 3\r\n[rank0]: a\r\n[rank0]: b\n"
            "[rank0]: \n");
}

TEST(LauncherExitStatus, DescribesAndMapsToShellCodes) {
  const ExitStatus code{.signaled = false, .value = 3};
  EXPECT_EQ(code.describe(), "exited with code 3");
  EXPECT_EQ(code.as_exit_code(), 3);
  EXPECT_FALSE(code.success());
  const ExitStatus segv{.signaled = true, .value = SIGSEGV};
  EXPECT_EQ(segv.describe(), "was killed by signal 11 (SIGSEGV)");
  EXPECT_EQ(segv.as_exit_code(), 139);
  EXPECT_TRUE((ExitStatus{.signaled = false, .value = 0}).success());
}

TEST(LauncherUniqueFd, ClosesOnDestructionAndMoves) {
  Pipe pipe = make_pipe(O_CLOEXEC);
  const int raw = pipe.read_end.get();
  {
    UniqueFd moved = std::move(pipe.read_end);
    EXPECT_FALSE(pipe.read_end.valid());
    EXPECT_EQ(moved.get(), raw);
    EXPECT_NE(::fcntl(raw, F_GETFD), -1);
  }
  EXPECT_EQ(::fcntl(raw, F_GETFD), -1);  // closed by the destructor
}

}  // namespace
}  // namespace mdist::launcher
