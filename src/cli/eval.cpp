// `mdist eval`: perplexity of a model on data, loss sums and token counts reduced across ranks.
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>

#include "mdist/hf/safetensors.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/io/atomic_file.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"
#include "mdist/tp/cross_entropy.h"
#include "mdist/train/evaluate.h"
#include "src/cli/commands.h"
#include "src/cli/job.h"
#include "src/cli/sft_data.h"

namespace mdist::cli {

int run_eval(const EvalOptions& o) {
  const Session session(setup_options(o.io.timeout_s));
  configure_threads();
  ModelChoice choice;
  TokenStream data;
  std::optional<SftSequences> sft;  // --format sft
  std::optional<MixedPrecisionPolicy> mp_policy;
  agree_on_inputs([&] {
    mp_policy = parse_param_dtype(o.io.param_dtype);
    check_at_least(o.batch_size, 1, "--batch-size");
    if (o.out) check_writable_file(*o.out, "output file");
    check_tensor_parallel_size(o.io.tensor_parallel);
    check_expert_parallel_size(o.io.expert_parallel, o.io.tensor_parallel);
    check_sft_flags(o.io);
    choice = model_for_inference(o.io.model_dir, o.default_run);
    check_tensor_parallel(o.io.tensor_parallel, choice.config);
    check_expert_parallel(o.io.expert_parallel, o.io.tensor_parallel, choice.config);
    if (o.io.sft()) {
      sft = load_checked_sft(*o.io.data, o.io, choice);
    } else {
      data = load_checked_data(o.io, DataSplit::eval, choice, "eval");
    }
  });
  std::optional<Windows> windows;
  if (!sft) windows.emplace(data, o.io.seq_len, "eval");
  const std::string description = sft ? sft->description : data.description;
  const std::int64_t sequences = sft ? sft->rows() : windows->count();
  const JobLayout layout = make_layout(o.io.tensor_parallel, o.io.expert_parallel);
  const ParallelState& parallel = layout.parallel;
  const hf::ParallelModel built = build_wrapped_model(choice, o.io.seed, layout, mp_policy);
  hf::CausalLM model = built.model;
  // A quantized checkpoint is evaluated as its quantized model: weights dequantized by the
  // loader, inputs fake-quantized with the checkpoint's input scales.
  const auto quantizers = checkpoint_quantizers(choice, built);
  say("mdist eval: model " + choice.description);
  if (mp_policy) say("mdist eval: " + describe_mixed_precision(*mp_policy, model));
  say("mdist eval: " + tokenizer_line(choice));
  say("mdist eval: data " + description + ", " + std::to_string(sequences) + " sequences of " +
      std::to_string(o.io.seq_len) + " tokens on " + describe_layout(layout));
  const train::HeldOutLoss held = train::held_out_loss(
      model, built.parallelism, sft ? sft_source(*sft) : sequence_source(*windows, description),
      parallel, o.batch_size);
  const int64_t T = o.io.seq_len;
  const double total_loss = held.loss_sum;
  const int64_t total_tokens = held.tokens;
  const double mean = total_loss / static_cast<double>(total_tokens);
  const double perplexity = std::exp(mean);
  char line[256];
  std::snprintf(line, sizeof(line),
                "mdist eval: loss %.6f nats/token, perplexity %.6f, %lld tokens predicted", mean,
                perplexity, static_cast<long long>(total_tokens));
  say(line);
  if (o.out && rank() == 0) {
    if (o.out->has_parent_path()) std::filesystem::create_directories(o.out->parent_path());
    const nlohmann::json result = {
        {"model", choice.description}, {"data", description},    {"seq_len", T},
        {"tokens", total_tokens},      {"loss_sum", total_loss}, {"loss", mean},
        {"perplexity", perplexity}};
    io::write_file_atomically(*o.out, result.dump(2) + "\n");
  }
  return 0;
}

}  // namespace mdist::cli
