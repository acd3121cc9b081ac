#pragma once
// The fixture of the `mdist` command's end-to-end tests: runs mdist through the project's
// launcher with real processes in a fresh directory per test, and reads what it wrote.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/subprocess.h"

extern char** environ;

namespace mdist::testing {

namespace fs = std::filesystem;

// Small enough for a 2-core machine: 10 steps of 4 sequences of 32 bytes.
inline const std::vector<std::string> kQuickTrain = {"--seq-len", "32", "--global-batch", "4",
                                                     "--warmup",  "2",  "--log-every",    "1"};

// The lines of a job's stderr that report an error ("...: error: ..."; the launcher adds its
// own summary of which rank failed, without one). A bad input gives exactly one.
inline int error_lines(const std::string& err) {
  std::istringstream lines(err);
  int errors = 0;
  for (std::string line; std::getline(lines, line);) {
    errors += line.find(": error: ") != std::string::npos;
  }
  return errors;
}

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
  // every rank count). `stdout_terminal`: the launcher's stdout is a pseudo-terminal.
  static RunResult mdist(int ranks, std::vector<std::string> args,
                         const std::map<std::string, std::string>& env = {},
                         bool stdout_terminal = false) {
    std::vector<std::string> argv = {MDIST_LAUNCHER, "--nproc-per-node", std::to_string(ranks),
                                     MDIST_CLI};
    argv.insert(argv.end(), args.begin(), args.end());
    mdist::testing::RunOptions options;
    options.env["OMP_NUM_THREADS"] = "1";
    for (const auto& [name, value] : env) options.env[name] = value;
    options.timeout = std::chrono::seconds(240);
    options.stdout_terminal = stdout_terminal;
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

  // The lines of metrics.jsonl that have `key`: "loss" for the training steps, "eval_loss"
  // for the held-out evaluations.
  static std::vector<nlohmann::json> metrics(const fs::path& run, const char* key = "loss") {
    std::vector<nlohmann::json> lines;
    std::ifstream in(run / "metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      // A line still being written (the run is live) is not valid JSON yet: skipped.
      auto json = nlohmann::json::parse(line, nullptr, false);
      if (json.is_object() && json.contains(key)) lines.push_back(std::move(json));
    }
    return lines;
  }

  // Every file and directory under `dir` (relative paths), to prove nothing was touched.
  static std::set<std::string> tree(const fs::path& dir) {
    std::set<std::string> paths;
    if (!fs::exists(dir)) return paths;
    for (const auto& entry : fs::recursive_directory_iterator(dir)) {
      paths.insert(fs::relative(entry.path(), dir).string());
    }
    return paths;
  }

  static std::string read(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
  }

  // Starts `argv` in the background with stdout and stderr into `log` (or /dev/null); the pid,
  // or 0 when it could not start.
  static pid_t spawn(std::vector<std::string> argv, const fs::path& log = "/dev/null") {
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    pid_t pid = 0;
    const int failed = posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, cargv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    return failed == 0 ? pid : 0;
  }

  // The child of `launcher` whose environment has RANK=`rank`; 0 if there is none (yet).
  static pid_t rank_process(pid_t launcher, int rank) {
    const std::string wanted = std::string("\0RANK=", 6) + std::to_string(rank) + '\0';
    for (const auto& entry : fs::directory_iterator("/proc")) {
      const std::string pid = entry.path().filename();
      if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream stat(entry.path() / "stat");
      std::string field;
      for (int i = 0; i < 4 && stat >> field; ++i) {
      }
      if (field != std::to_string(launcher)) continue;
      if (read(entry.path() / "environ").find(wanted) != std::string::npos) {
        return static_cast<pid_t>(std::stoi(pid));
      }
    }
    return 0;
  }

  // Waits for `launcher` to end while SIGKILLing rank `rank` of its attempts, each new one at
  // most once, whenever `ready(kills so far)` says so (it may sleep first), up to `max_kills`
  // kills or `limit`. The launcher's wait status and the kills done.
  struct Kills {
    int status = 0;
    int kills = 0;
  };
  static Kills kill_rank_while_running(pid_t launcher, int rank, int max_kills,
                                       std::chrono::seconds limit,
                                       const std::function<bool(int)>& ready) {
    Kills done;
    pid_t last = 0;
    bool ended = false;
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (done.kills < max_kills && std::chrono::steady_clock::now() < deadline) {
      if (waitpid(launcher, &done.status, WNOHANG) == launcher) {
        ended = true;
        break;
      }
      const pid_t victim = rank_process(launcher, rank);
      if (victim == 0 || victim == last || !ready(done.kills)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      if (kill(victim, SIGKILL) == 0) ++done.kills;
      last = victim;
    }
    if (!ended) {
      EXPECT_EQ(waitpid(launcher, &done.status, 0), launcher);
    }
    return done;
  }

  static std::string describe(const RunResult& r) {
    return "exit " + std::to_string(r.exit_code) + "\nstdout:\n" + r.out + "\nstderr:\n" + r.err;
  }

#ifdef MDIST_SAVE_FOR_TRANSFORMERS
  // A seeded Qwen3-MoE directory in dir_/NAME (two sparse layers, top-`top_k` of `experts`,
  // hidden 32, byte vocabulary, load-balancing coefficient `aux`, in the objective when it is
  // not 0: output_router_logits), written by mdist's save_pretrained. norm_topk_prob only for
  // top_k > 1: normalising one routing weight makes it 1, and the router's gradient rounding
  // noise that AdamW turns into layout-dependent steps.
  fs::path qwen3_moe_model(const std::string& name, int experts, double aux = 0.01, int top_k = 2) {
    const auto config_dir = dir_ / (name + "-config");
    fs::create_directories(config_dir);
    std::ofstream(config_dir / "config.json")
        << R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
               "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
               "vocab_size": 256, "num_experts": )"
        << experts << R"(, "num_experts_per_tok": )" << top_k
        << R"(, "moe_intermediate_size": 16, "norm_topk_prob": )" << (top_k > 1 ? "true" : "false")
        << R"(, "output_router_logits": )" << (aux != 0 ? "true" : "false")
        << R"(, "router_aux_loss_coef": )" << aux << "}\n";
    const auto model = dir_ / name;
    const auto r = run({MDIST_SAVE_FOR_TRANSFORMERS, config_dir.string(), model.string()});
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    return model;
  }
#endif

  fs::path dir_;
};

}  // namespace mdist::testing
