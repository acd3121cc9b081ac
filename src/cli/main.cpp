// mdist: the main job. Trains, evaluates, calibrates and samples a Hugging Face causal LM
// across the ranks of a job started by mdistrun (or torchrun), or in a single process.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
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

constexpr const char* kTpHelp =
    "Tensor-parallel size: the model is split over groups of this many consecutive ranks "
    "(Megatron style) and the data over world / tp data-parallel ranks";

void add_tensor_parallel(CLI::App& app, int& tp) {
  app.add_option("--tp", tp, kTpHelp)->capture_default_str();
}

constexpr const char* kEpHelp =
    "Expert-parallel size: each mixture-of-experts layer's experts are split over groups of "
    "this many data-parallel ranks (Megatron style: dp = ep x expert-data-parallel), tokens "
    "sent to their experts' ranks by all-to-all";

void add_expert_parallel(CLI::App& app, int& ep) {
  app.add_option("--ep", ep, kEpHelp)->capture_default_str();
}

void add_timeout(CLI::App& app, std::optional<double>& timeout_s) {
  app.add_option("--timeout", timeout_s,
                 "Seconds a collective may wait for the other ranks before the job fails "
                 "(default: MDIST_TIMEOUT, else 1800)")
      ->type_name("SECONDS");
}

// This process's rank as the launcher set it (before the job is joined): only rank 0 reports
// a usage error, which every rank sees alike.
void add_param_dtype(CLI::App& app, std::string& param_dtype) {
  app.add_option("--param-dtype", param_dtype,
                 "Mixed precision (FSDP2's param_dtype): gather and compute in bf16 (or fp32); "
                 "in training, gradients are reduced in fp32 and the weights and AdamW state "
                 "keep their dtype (default: compute in the weights' dtype)")
      ->type_name("DTYPE");
}

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

void add_model_data(CLI::App& app, ModelDataOptions& io, bool with_model = true) {
  if (with_model) {
    app.add_option("--model", io.model_dir,
                   "Hugging Face model directory (config.json + safetensors)")
        ->type_name("DIR");
  }
  app.add_option("--data", io.data, "Data file (default: the embedded corpus)")->type_name("FILE");
  app.add_option("--data-format", io.data_format,
                 "text (through the model's tokenizer.json, else one token per byte), ids "
                 "(whitespace-separated decimal ids), u16, u32 or i32 (little-endian binary, "
                 "memory-mapped), or auto (by extension: .ids, .u16/.bin, .u32, .i32, else text)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "text", "ids", "u16", "u32", "i32"}));
  app.add_option("--split", io.split,
                 "Part of the data: all, train (first 90%), eval (last 10%); auto: the "
                 "command's split of the embedded corpus, all of a --data file")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "all", "train", "eval"}));
  app.add_option("--seq-len", io.seq_len, "Tokens per sequence")->capture_default_str();
  app.add_option("--seed", io.seed, "Seed of the initialisation and the data order")
      ->capture_default_str();
  add_tensor_parallel(app, io.tensor_parallel);
  add_expert_parallel(app, io.expert_parallel);
  add_timeout(app, io.timeout_s);
  add_param_dtype(app, io.param_dtype);
}

int report(const char* command, const std::exception& error, int code, bool print) {
  if (!print) return exit_after_rank0(code);
  std::string message = error.what();
  message = message.substr(0, message.find('\n'));
  std::cerr << "mdist " << command << ": error: " << message << std::endl;
  return code;
}

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
  auto* train_cmd = app.add_subcommand("train", "Train a causal LM (sharded with fsdp2_wrap)");
  add_model_data(*train_cmd, train.io);
  train_cmd->add_option("--out", train.out, "Run directory: metrics.jsonl, loss.svg, checkpoints/")
      ->capture_default_str()
      ->type_name("DIR");
  train_cmd->add_option("--steps", train.steps, "Optimizer steps")->capture_default_str();
  train_cmd
      ->add_option("--global-batch", train.global_batch,
                   "Sequences per step over all data-parallel ranks (must divide evenly)")
      ->capture_default_str();
  train_cmd->add_option("--lr", train.lr, "Peak learning rate (AdamW)")->capture_default_str();
  train_cmd
      ->add_option("--min-lr-ratio", train.min_lr_ratio,
                   "Cosine decay ends at this fraction of --lr")
      ->capture_default_str();
  train_cmd->add_option("--warmup", train.warmup, "Linear warm-up steps")->capture_default_str();
  train_cmd->add_option("--weight-decay", train.weight_decay, "AdamW weight decay (matrices)")
      ->capture_default_str();
  train_cmd
      ->add_option("--grad-clip", train.grad_clip,
                   "Clip the global gradient norm to this (0: no clipping)")
      ->capture_default_str();
  train_cmd
      ->add_option("--save-every", train.save_every,
                   "Checkpoint every K steps (0: only at the end)")
      ->capture_default_str();
  train_cmd->add_option("--keep", train.keep, "Checkpoints kept (the newest)")
      ->capture_default_str();
  train_cmd
      ->add_option("--log-every", train.log_every,
                   "Log line every K steps when stdout is not a terminal")
      ->capture_default_str();
  std::string resume;
  train_cmd
      ->add_option("--resume", resume,
                   "Continue from the run directory's last checkpoint (its model: no --model); "
                   "--resume auto: continue if there is one, else start (from --model if given)")
      ->expected(0, 1)
      ->default_str("always")
      ->check(CLI::IsMember({"always", "auto"}))
      ->type_name("[auto]");
  train_cmd->add_flag("--overwrite", train.overwrite,
                      "Replace an earlier run in --out (its metrics and checkpoints); without "
                      "it a fresh run into a directory holding one is refused");
  train_cmd->add_flag("--skip-nonfinite-steps", train.skip_nonfinite,
                      "Skip (no update) a step whose loss or gradient norm is not finite, "
                      "counted in metrics.jsonl; without it such a step stops the run");
  train_cmd
      ->add_option("--eval-every", train.eval_every,
                   "Held-out loss every K steps (default: at each checkpoint; 0: never)")
      ->type_name("K");
  train_cmd
      ->add_option("--eval-data", train.eval_data,
                   "Held-out data (same --data-format); default: the eval split (last 10%) of "
                   "the training data when --split is train (the embedded corpus' default)")
      ->type_name("FILE");
  train_cmd
      ->add_option("--watchdog", train.watchdog_s,
                   "Rank 0 reports a rank that has not reached the others' step for this many "
                   "seconds (0: never)")
      ->capture_default_str()
      ->type_name("SECONDS");
  train_cmd
      ->add_option("--router-aux-loss-coef", train.router_aux_loss_coef,
                   "Weight of a mixture of experts' load-balancing loss in the objective "
                   "(0: none); default: the config's router_aux_loss_coef when its "
                   "output_router_logits is true, else none (as transformers)")
      ->type_name("W");
  train_cmd
      ->add_option("--eval-max-sequences", train.eval_max_sequences,
                   "Held-out sequences per evaluation (0: all)")
      ->capture_default_str();
  train_cmd->footer(
      "\nExample: mdistrun --nproc-per-node 2 mdist train --steps 600 --out runs/long");

  EvalOptions eval;
  auto* eval_cmd = app.add_subcommand(
      "eval", "Perplexity of a model on data (default: the last 10% of the embedded corpus)");
  add_model_data(*eval_cmd, eval.io);
  eval_cmd->add_option("--batch-size", eval.batch_size, "Sequences per forward on each rank")
      ->capture_default_str();
  eval_cmd->add_option("--out", eval.out, "Also write the result as JSON to FILE")
      ->type_name("FILE");
  eval_cmd->footer(
      "\nWithout --model: the latest checkpoint of runs/default, else the seeded default model.");

  CalibrateOptions calibrate;
  auto* calibrate_cmd = app.add_subcommand(
      "calibrate", "Abs-max calibration of every Linear's input and weight (for quantization)");
  add_model_data(*calibrate_cmd, calibrate.io);
  calibrate_cmd
      ->add_option("--max-sequences", calibrate.max_sequences,
                   "Sequences to run over all ranks (0: all)")
      ->capture_default_str();
  calibrate_cmd->add_option("--out", calibrate.out, "JSON output file")
      ->capture_default_str()
      ->type_name("FILE");
  calibrate_cmd->add_flag("--allow-incomplete-moe", calibrate.allow_incomplete_moe,
                          "Write the result although some routed experts received no "
                          "calibration tokens on some or all of their ranks (they are "
                          "reported; an expert no rank saw gets input_absmax null)");
  calibrate_cmd->footer(
      "\nWithout --model: the latest checkpoint of runs/default, else the seeded default model.");

  GenerateOptions generate;
  auto* generate_cmd =
      app.add_subcommand("generate", "Sample text from a prompt with a byte-level model");
  generate_cmd->add_option("--model", generate.model_dir, "Hugging Face model directory")
      ->type_name("DIR");
  generate_cmd->add_option("--prompt", generate.prompt, "Text to continue")->capture_default_str();
  generate_cmd->add_option("--max-new-tokens", generate.max_new_tokens, "Bytes to generate")
      ->capture_default_str();
  generate_cmd->add_option("--temperature", generate.temperature, "Softmax temperature")
      ->capture_default_str();
  generate_cmd->add_option("--top-k", generate.top_k, "Sample among the k likeliest (0: all)")
      ->capture_default_str();
  generate_cmd->add_flag("--greedy", generate.greedy, "Always take the likeliest byte");
  generate_cmd->add_option("--seed", generate.seed, "Sampling seed")->capture_default_str();
  add_tensor_parallel(*generate_cmd, generate.tensor_parallel);
  add_timeout(*generate_cmd, generate.timeout_s);
  add_param_dtype(*generate_cmd, generate.param_dtype);
  generate_cmd->footer(
      "\nWithout --model: the latest checkpoint of runs/default, else the seeded default model.");

  TokenizeOptions tokenize;
  auto* tokenize_cmd = app.add_subcommand(
      "tokenize", "Tokenize a text or JSON Lines corpus into a .u16/.u32 token file");
  tokenize_cmd->add_option("--model", tokenize.model_dir, "Model directory with tokenizer.json")
      ->required()
      ->type_name("DIR");
  tokenize_cmd->add_option("--data", tokenize.data, "Corpus: text or JSON Lines")
      ->required()
      ->type_name("FILE");
  tokenize_cmd
      ->add_option("--out", tokenize.out,
                   "Token file: .u32 (little-endian uint32) or .u16 (when the vocabulary fits); "
                   "written atomically, the same bytes on any number of ranks")
      ->required()
      ->type_name("FILE");
  tokenize_cmd->add_option("--format", tokenize.format, "text or jsonl")->capture_default_str();
  tokenize_cmd->add_option("--field", tokenize.field, "jsonl: the field holding the text")
      ->capture_default_str();
  tokenize_cmd
      ->add_option("--sample-by", tokenize.sample_by,
                   "text: a document is a line, a paragraph (lines up to an empty line) or the "
                   "whole file")
      ->capture_default_str();
  add_timeout(*tokenize_cmd, tokenize.timeout_s);
  tokenize_cmd->footer(
      "\nEach document is encoded with its special tokens, then EOS. Under mdistrun the ranks "
      "split the corpus at document boundaries.");

  InfoOptions info;
  auto* info_cmd =
      app.add_subcommand("info", "Versions, backends, devices, and this job's ranks and groups");
  add_tensor_parallel(*info_cmd, info.tensor_parallel);
  add_expert_parallel(*info_cmd, info.expert_parallel);
  add_timeout(*info_cmd, info.timeout_s);

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

  train.resume = resume.empty()     ? ResumeMode::off
                 : resume == "auto" ? ResumeMode::automatic
                                    : ResumeMode::always;
  const std::string command = app.get_subcommands().front()->get_name();
  try {
    // The timeout is read before the job is joined: a bad one is the same on every rank.
    const std::optional<double> timeout = command == "train"       ? train.io.timeout_s
                                          : command == "eval"      ? eval.io.timeout_s
                                          : command == "calibrate" ? calibrate.io.timeout_s
                                          : command == "generate"  ? generate.timeout_s
                                          : command == "tokenize"  ? tokenize.timeout_s
                                                                   : info.timeout_s;
    (void)setup_options(timeout);
  } catch (const InputError& error) {
    return report(command.c_str(), error, 2, launch_rank0());
  }
  try {
    if (command == "train") return run_train(train);
    if (command == "eval") return run_eval(eval);
    if (command == "calibrate") return run_calibrate(calibrate);
    if (command == "generate") return run_generate(generate);
    if (command == "tokenize") return run_tokenize(tokenize);
    return run_info(info);
  } catch (const AgreedFailure& error) {
    return report(command.c_str(), error, error.exit_code(), error.reporter());
  } catch (const InputError& error) {
    return report(command.c_str(), error, 2, true);
  } catch (const std::exception& error) {
    return report(command.c_str(), error, 1, true);
  }
}
