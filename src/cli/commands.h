#pragma once
// The subcommands of the `mdist` command. Each declares its flags, defaults, help and validation
// next to its options struct (src/cli/NAME_options.h); main.cpp only dispatches. Each run_*
// joins the job described by the environment (mdistrun / torchrun variables; a plain process
// is a job of one rank), checks its inputs on every rank and agrees on them before any output
// file is created, and returns the process exit code.
#include "src/cli/calibrate_options.h"
#include "src/cli/eval_options.h"
#include "src/cli/generate_options.h"
#include "src/cli/info_options.h"
#include "src/cli/quantize_options.h"
#include "src/cli/tokenize_options.h"
#include "src/cli/train_options.h"

namespace mdist::cli {

int run_train(const TrainOptions& options);
int run_eval(const EvalOptions& options);
int run_calibrate(const CalibrateOptions& options);
int run_quantize(const QuantizeOptions& options);
int run_generate(const GenerateOptions& options);
int run_info(const InfoOptions& options);
int run_tokenize(const TokenizeOptions& options);

}  // namespace mdist::cli
