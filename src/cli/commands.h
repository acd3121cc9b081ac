#pragma once
// The subcommands of the `mdist` command and their options (parsed in main.cpp). Each run_*
// joins the job described by the environment (mdistrun / torchrun variables; a plain process
// is a job of one rank), checks its inputs on every rank and agrees on them before any output
// file is created, and returns the process exit code.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace mdist::cli {

// Where the model and the data come from. Empty model_dir: the embedded default (see each
// command); empty data: the embedded corpus.
struct ModelDataOptions {
  std::optional<std::filesystem::path> model_dir;
  std::optional<std::filesystem::path> data;
  std::string data_format = "auto";
  std::string split = "auto";  // auto: train/eval split of the embedded corpus, else "all"
  std::int64_t seq_len = 128;
  std::uint64_t seed = 1234;
  int tensor_parallel = 1;          // --tp: ranks per tensor-parallel group (dp = world / tp)
  int expert_parallel = 1;          // --ep: ranks per expert-parallel group (carved out of dp)
  std::optional<double> timeout_s;  // --timeout (else MDIST_TIMEOUT, else 30 min)
  // --param-dtype: empty (compute in the weights' dtype), or the dtype FSDP2's mixed precision
  // gathers and computes in (parse_param_dtype). The same in train, eval and calibrate, so a
  // held-out loss logged by train is what eval gives for the checkpoint.
  std::string param_dtype;
};

// --resume: off (a fresh run), always (bare --resume: continue, a checkpoint must exist), or
// automatic (--resume auto: continue when the run directory has a checkpoint, else start; the
// same command line then serves every restart of a job).
enum class ResumeMode { off, always, automatic };

struct TrainOptions {
  ModelDataOptions io;
  std::filesystem::path out = "runs/default";
  int steps = 300;
  std::int64_t global_batch = 16;
  double lr = 3e-3;
  double min_lr_ratio = 0.1;
  int warmup = 30;
  double weight_decay = 0.1;
  double grad_clip = 1.0;
  int save_every = 100;  // 0: only at the end
  int keep = 2;          // checkpoints kept (the newest)
  int log_every = 10;
  ResumeMode resume = ResumeMode::off;
  bool overwrite = false;       // replace an earlier run in `out` (never the --model source)
  bool skip_nonfinite = false;  // skip a step whose loss or gradient norm is not finite
  // Held-out loss every K steps; nullopt: at each checkpoint; 0: never.
  std::optional<int> eval_every;
  std::optional<std::filesystem::path> eval_data;  // else the eval split of the training data
  std::int64_t eval_max_sequences = 256;           // 0: all
  double watchdog_s = 300;  // report a rank that lags the others' step this long (0: never)
  // --router-aux-loss-coef: the weight of a mixture of experts' load-balancing loss in the
  // objective. nullopt: the config's (router_aux_loss_coef when output_router_logits is true,
  // else none, as transformers); 0: none; else this weight.
  std::optional<double> router_aux_loss_coef;
};

struct EvalOptions {
  ModelDataOptions io;
  std::int64_t batch_size = 8;               // sequences per forward on each rank
  std::optional<std::filesystem::path> out;  // JSON result
  std::filesystem::path default_run = "runs/default";
};

struct CalibrateOptions {
  ModelDataOptions io;
  std::int64_t max_sequences = 64;  // 0: all
  std::filesystem::path out = "runs/default/calibration.json";
  std::filesystem::path default_run = "runs/default";
  // Write the JSON although some routed experts got no calibration tokens (reported).
  bool allow_incomplete_moe = false;
};

struct GenerateOptions {
  std::optional<std::filesystem::path> model_dir;
  std::string prompt = "MACBETH.\n";
  int max_new_tokens = 300;
  double temperature = 0.8;
  int top_k = 40;
  bool greedy = false;
  std::uint64_t seed = 1234;
  int tensor_parallel = 1;
  std::optional<double> timeout_s;
  std::string param_dtype;  // as ModelDataOptions::param_dtype
  std::filesystem::path default_run = "runs/default";
};

struct TokenizeOptions {
  std::filesystem::path model_dir;  // holds tokenizer.json
  std::filesystem::path data;
  std::filesystem::path out;       // .u16 or .u32
  std::string format = "text";     // text or jsonl
  std::string field = "text";      // jsonl: the text's field
  std::string sample_by = "line";  // text: line, paragraph or document
  std::optional<double> timeout_s;
};

struct InfoOptions {
  int tensor_parallel = 1;
  int expert_parallel = 1;
  std::optional<double> timeout_s;
};

int run_train(const TrainOptions& options);
int run_eval(const EvalOptions& options);
int run_calibrate(const CalibrateOptions& options);
int run_generate(const GenerateOptions& options);
int run_info(const InfoOptions& options);
int run_tokenize(const TokenizeOptions& options);

}  // namespace mdist::cli
