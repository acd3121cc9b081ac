// `mdist eval`: perplexity of a model on data, loss sums and token counts reduced across ranks.
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>

#include "mdist/hf/safetensors.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"
#include "mdist/tp/cross_entropy.h"
#include "src/cli/commands.h"
#include "src/cli/forward_split.h"
#include "src/cli/held_out.h"
#include "src/cli/job.h"

namespace mdist::cli {

HeldOutLoss held_out_loss(hf::CausalLM& model, const hf::Parallelism& parallelism,
                          const Windows& windows, const ParallelState& parallel,
                          std::int64_t batch_size, std::int64_t max_windows) {
  const bool training = model->is_training();
  model->eval();
  const torch::NoGradGuard no_grad;
  const int64_t total = max_windows > 0 ? std::min(max_windows, windows.count()) : windows.count();
  const auto plan = plan_forwards(total, mdist::size(parallel.data_parallel_group.group()),
                                  mdist::rank(parallel.data_parallel_group.group()), batch_size);
  const int64_t T = windows.seq_len();
  double loss_sum = 0;
  int64_t tokens = 0;
  for (int64_t round = 0; round < plan.rounds; ++round) {
    const auto first = static_cast<std::size_t>(round * batch_size);
    const int64_t real = std::clamp<int64_t>(
        static_cast<int64_t>(plan.windows.size()) - static_cast<int64_t>(first), 0, batch_size);
    // A dummy window keeps the collectives going on a rank that has run out.
    const std::vector<int64_t> which =
        real > 0
            ? std::vector<int64_t>(plan.windows.begin() + static_cast<std::ptrdiff_t>(first),
                                   plan.windows.begin() + static_cast<std::ptrdiff_t>(first) + real)
            : std::vector<int64_t>{0};
    const at::Tensor ids = batch_of(windows, which).to(compute_device());
    const at::Tensor logits = model->forward(ids);
    if (real == 0) continue;
    // Per-token losses summed in double: the total must not depend on how the sequences were
    // grouped into batches and ranks.
    const auto V = logits.size(-1);
    const at::Tensor shifted = logits.narrow(1, 0, T - 1).reshape({-1, V}).to(torch::kFloat);
    const at::Tensor labels = ids.narrow(1, 1, T - 1).reshape({-1});
    const auto& split = parallelism.tensor_parallel;
    const at::Tensor per_token =
        parallelism.tensor_parallel_split()
            ? tp::vocab_parallel_token_losses(shifted, labels, split->group(), split->vocab_start(),
                                              -100, split->counters())
            : torch::nn::functional::cross_entropy(
                  shifted, labels,
                  torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    loss_sum += per_token.to(torch::kDouble).sum().item<double>();
    tokens += real * (T - 1);
  }
  if (training) model->train();
  // Over the data-parallel group: the tensor-parallel ranks of one hold the same losses.
  const Group dp = parallel.data_parallel_group.group();
  return {allreduce(loss_sum, "sum", dp), allreduce(tokens, "sum", dp)};
}

int run_eval(const EvalOptions& o) {
  const Session session(setup_options(o.io.timeout_s));
  configure_threads();
  ModelChoice choice;
  TokenStream data;
  std::optional<MixedPrecisionPolicy> mp_policy;
  agree_on_inputs([&] {
    mp_policy = parse_param_dtype(o.io.param_dtype);
    check_at_least(o.batch_size, 1, "--batch-size");
    if (o.out) check_writable_file(*o.out, "output file");
    check_tensor_parallel_size(o.io.tensor_parallel);
    check_expert_parallel_size(o.io.expert_parallel, o.io.tensor_parallel);
    choice = model_for_inference(o.io.model_dir, o.default_run);
    check_tensor_parallel(o.io.tensor_parallel, choice.config);
    check_expert_parallel(o.io.expert_parallel, o.io.tensor_parallel, choice.config);
    data = load_checked_data(o.io, DataSplit::eval, choice, "eval");
  });
  const Windows windows(data, o.io.seq_len, "eval");
  const JobLayout layout = make_layout(o.io.tensor_parallel, o.io.expert_parallel);
  const ParallelState& parallel = layout.parallel;
  const hf::ParallelModel built = build_wrapped_model(choice, o.io.seed, layout, mp_policy);
  hf::CausalLM model = built.model;
  say("mdist eval: model " + choice.description);
  if (mp_policy) say("mdist eval: " + describe_mixed_precision(*mp_policy, model));
  say("mdist eval: " + tokenizer_line(choice));
  say("mdist eval: data " + data.description + ", " + std::to_string(windows.count()) +
      " sequences of " + std::to_string(o.io.seq_len) + " tokens on " + describe_layout(layout));
  const HeldOutLoss held = held_out_loss(model, built.parallelism, windows, parallel, o.batch_size);
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
        {"model", choice.description}, {"data", data.description}, {"seq_len", T},
        {"tokens", total_tokens},      {"loss_sum", total_loss},   {"loss", mean},
        {"perplexity", perplexity}};
    hf::write_file_atomically(*o.out, result.dump(2) + "\n");
  }
  return 0;
}

}  // namespace mdist::cli
