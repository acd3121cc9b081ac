// mdist: the main job. Trains, evaluates, calibrates and samples a Hugging Face causal LM
// across the ranks of a job started by mdistrun (or torchrun), or in a single process.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "src/cli/commands.h"
#include "src/cli/job.h"

namespace {

using namespace mdist::cli;

constexpr const char* kFooter = R"(
Run on several ranks through the launcher, e.g.
  mdistrun --nproc-per-node 2 mdist train
Every subcommand runs with no arguments on the embedded default: a small Llama-style model
(data/default/config.json) and Shakespeare's Macbeth as bytes (data/corpus/macbeth.txt).)";

bool launch_rank0() {
  const char* rank = std::getenv("RANK");
  return rank == nullptr || *rank == '\0' || std::strcmp(rank, "0") == 0;
}

// The exit of a rank that leaves an error every rank saw for rank 0 to report. A launcher
// (mdistrun, torchrun) stops the whole job when its first rank exits, and rank 0 may still be
// loading libtorch or finishing the collective that agreed on the error: exiting at once would
// get it killed before its line reaches stderr. So this rank waits (up to 10 s) for the
// launcher to stop it once rank 0 has reported and exited.
int exit_after_rank0(int code) {
  const char* world = std::getenv("WORLD_SIZE");
  if (world != nullptr && std::atoi(world) > 1)
    std::this_thread::sleep_for(std::chrono::seconds(10));
  return code;
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// A usage error: one line on stderr (rank 0 only), exit code 2, and for a mistyped subcommand
// the nearest one.
int usage_error(const CLI::App& app, const CLI::ParseError& error, int argc, char** argv) {
  if (!launch_rank0()) return exit_after_rank0(2);
  std::string command = "mdist";
  for (const auto* sub : app.get_subcommands()) command += " " + sub->get_name();
  std::string message = error.what();
  message = message.substr(0, message.find('\n'));
  if (argc > 1 && argv[1][0] != '-' && app.get_subcommands().empty()) {
    const std::string typed = argv[1];
    std::string nearest;
    std::size_t best = 3;  // suggest within two edits
    std::string names;
    for (const auto* sub : app.get_subcommands({})) {
      names += (names.empty() ? "" : ", ") + sub->get_name();
      if (const auto d = edit_distance(typed, sub->get_name()); d < best) {
        best = d;
        nearest = sub->get_name();
      }
    }
    message = "unknown subcommand '" + typed + "'" +
              (nearest.empty() ? "" : " (did you mean '" + nearest + "'?)") +
              "; the subcommands are " + names;
  }
  std::cerr << command << ": error: " << message << " (see " << command << " --help)" << std::endl;
  return 2;
}

int report(const char* command, const std::exception& error, int code, bool print) {
  if (!print) return exit_after_rank0(code);
  std::string message = error.what();
  message = message.substr(0, message.find('\n'));
  std::cerr << "mdist " << command << ": error: " << message << std::endl;
  return code;
}

// A subcommand as main() dispatches it: its flags (declared on its CLI::App), the --timeout
// it was given (read before the job is joined) and what runs it. The options they act on live
// in main's frame.
struct Subcommand {
  const char* name;
  const char* description;
  std::function<void(CLI::App&)> declare;
  std::function<std::optional<double>()> timeout;
  std::function<int()> run;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "mdist: train, evaluate, calibrate and sample causal language models with FSDP2 "
      "across ranks (libtorch, c10d Gloo/NCCL).",
      "mdist"};
  app.footer(kFooter);
  // A flag given twice takes its last value, as with argparse (scripts append overrides).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("mdist ") + MDIST_VERSION_STRING);

  TrainOptions train;
  EvalOptions eval;
  CalibrateOptions calibrate;
  QuantizeOptions quantize;
  GenerateOptions generate;
  TokenizeOptions tokenize;
  InfoOptions info;
  const std::vector<Subcommand> subcommands = {
      {"train", "Train a causal LM (sharded with fsdp2_wrap)",
       [&](CLI::App& cmd) { declare_train_flags(cmd, train); }, [&] { return train.io.timeout_s; },
       [&] { return run_train(train); }},
      {"eval", "Perplexity of a model on data (default: the last 10% of the embedded corpus)",
       [&](CLI::App& cmd) { declare_eval_flags(cmd, eval); }, [&] { return eval.io.timeout_s; },
       [&] { return run_eval(eval); }},
      {"calibrate", "Abs-max calibration of every Linear's input and weight (for quantization)",
       [&](CLI::App& cmd) { declare_calibrate_flags(cmd, calibrate); },
       [&] { return calibrate.io.timeout_s; }, [&] { return run_calibrate(calibrate); }},
      {"quantize",
       "Post-training quantization (fp8, int8) with modelopt's presets: held-out loss before "
       "and after, and the unified Hugging Face checkpoint",
       [&](CLI::App& cmd) { declare_quantize_flags(cmd, quantize); },
       [&] { return quantize.io.timeout_s; }, [&] { return run_quantize(quantize); }},
      {"generate", "Sample text from a prompt with a byte-level model",
       [&](CLI::App& cmd) { declare_generate_flags(cmd, generate); },
       [&] { return generate.timeout_s; }, [&] { return run_generate(generate); }},
      {"tokenize", "Tokenize a text or JSON Lines corpus into a .u16/.u32 token file",
       [&](CLI::App& cmd) { declare_tokenize_flags(cmd, tokenize); },
       [&] { return tokenize.timeout_s; }, [&] { return run_tokenize(tokenize); }},
      {"info", "Versions, backends, devices, and this job's ranks and groups",
       [&](CLI::App& cmd) { declare_info_flags(cmd, info); }, [&] { return info.timeout_s; },
       [&] { return run_info(info); }},
  };
  for (const auto& sub : subcommands) sub.declare(*app.add_subcommand(sub.name, sub.description));

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& error) {
    return app.exit(error);
  } catch (const CLI::CallForAllHelp& error) {
    return app.exit(error);
  } catch (const CLI::CallForVersion& error) {
    return app.exit(error);
  } catch (const CLI::ParseError& error) {
    return usage_error(app, error, argc, argv);
  }

  const std::string command = app.get_subcommands().front()->get_name();
  const Subcommand& chosen = *std::find_if(subcommands.begin(), subcommands.end(),
                                           [&](const Subcommand& s) { return s.name == command; });
  try {
    // The timeout is read before the job is joined: a bad one is the same on every rank.
    (void)setup_options(chosen.timeout());
  } catch (const InputError& error) {
    return report(command.c_str(), error, 2, launch_rank0());
  }
  try {
    return chosen.run();
  } catch (const AgreedFailure& error) {
    return report(command.c_str(), error, error.exit_code(), error.reporter());
  } catch (const mdist::AgreedError& error) {
    return report(command.c_str(), error, 1, launch_rank0());
  } catch (const InputError& error) {
    return report(command.c_str(), error, 2, true);
  } catch (const std::exception& error) {
    return report(command.c_str(), error, 1, true);
  }
}
