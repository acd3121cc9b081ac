// mdist: the main job. Trains, evaluates, calibrates and samples a Hugging Face causal LM
// across the ranks of a job started by mdistrun (or torchrun), or in a single process.
#include <CLI/CLI.hpp>

#include <csignal>
#include <cstring>
#include <iostream>
#include <string>

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

void add_model_data(CLI::App& app, ModelDataOptions& io, bool with_model = true) {
  if (with_model) {
    app.add_option("--model", io.model_dir,
                   "Hugging Face model directory (config.json + safetensors)")
        ->type_name("DIR");
  }
  app.add_option("--data", io.data, "Data file (default: the embedded corpus)")->type_name("FILE");
  app.add_option("--data-format", io.data_format,
                 "text (one token per byte), ids (whitespace-separated decimal ids), u16 or i32 "
                 "(little-endian binary), or auto (by extension: .ids, .u16/.bin, .i32, else text)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "text", "ids", "u16", "i32"}));
  app.add_option("--split", io.split,
                 "Part of the data: all, train (first 90%), eval (last 10%); auto: the "
                 "command's split of the embedded corpus, all of a --data file")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "all", "train", "eval"}));
  app.add_option("--seq-len", io.seq_len, "Tokens per sequence")->capture_default_str();
  app.add_option("--seed", io.seed, "Seed of the initialisation and the data order")
      ->capture_default_str();
  add_tensor_parallel(app, io.tensor_parallel);
}

int report(const char* command, const std::exception& error, int code, bool print) {
  if (print) {
    std::string message = error.what();
    message = message.substr(0, message.find('\n'));
    std::cerr << "mdist " << command << ": error: " << message << std::endl;
  }
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "mdist: train, evaluate, calibrate and sample causal language models with FSDP2 "
      "across ranks (libtorch, c10d Gloo/NCCL).",
      "mdist"};
  app.footer(kFooter);
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
  train_cmd->add_option("--grad-clip", train.grad_clip, "Clip the global gradient norm to this")
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
  train_cmd->add_flag("--resume", train.resume,
                      "Continue from the run directory's last checkpoint");
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
  generate_cmd->footer(
      "\nWithout --model: the latest checkpoint of runs/default, else the seeded default model.");

  InfoOptions info;
  auto* info_cmd =
      app.add_subcommand("info", "Versions, backends, devices, and this job's ranks and groups");
  add_tensor_parallel(*info_cmd, info.tensor_parallel);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error);
  }

  const std::string command = app.get_subcommands().front()->get_name();
  try {
    if (command == "train") return run_train(train);
    if (command == "eval") return run_eval(eval);
    if (command == "calibrate") return run_calibrate(calibrate);
    if (command == "generate") return run_generate(generate);
    return run_info(info);
  } catch (const AgreedInputError& error) {
    return report(command.c_str(), error, 2, error.reporter());
  } catch (const InputError& error) {
    return report(command.c_str(), error, 2, true);
  } catch (const std::exception& error) {
    return report(command.c_str(), error, 1, true);
  }
}
