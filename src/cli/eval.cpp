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
#include "src/cli/job.h"

namespace mdist::cli {

int run_eval(const EvalOptions& o) {
  const Session session;
  configure_threads();
  ModelChoice choice;
  TokenStream data;
  agree_on_inputs([&] {
    if (o.batch_size < 1) throw InputError("--batch-size must be at least 1");
    if (o.out) check_writable_file(*o.out, "output file");
    check_tensor_parallel_size(o.io.tensor_parallel);
    choice = model_for_inference(o.io.model_dir, o.default_run);
    check_tensor_parallel(o.io.tensor_parallel, choice.config);
    data = load_checked_data(o.io, DataSplit::eval, choice, "eval");
  });
  const Windows windows(data, o.io.seq_len, "eval");
  const ParallelState parallel = make_layout(o.io.tensor_parallel);
  const Group dp = parallel.data_parallel_group.group();
  hf::CausalLM model = build_wrapped_model(choice, o.io.seed, parallel);
  model->eval();
  const torch::NoGradGuard no_grad;
  say("mdist eval: model " + choice.description);
  say("mdist eval: data " + data.description + ", " + std::to_string(windows.count()) +
      " sequences of " + std::to_string(o.io.seq_len) + " tokens on " + describe_layout(parallel));

  const auto plan = plan_forwards(windows.count(), parallel.data_parallel_group.world_size(),
                                  parallel.data_parallel_group.rank(), o.batch_size);
  const int64_t T = o.io.seq_len;
  double loss_sum = 0;
  int64_t tokens = 0;
  for (int64_t round = 0; round < plan.rounds; ++round) {
    const auto first = static_cast<std::size_t>(round * o.batch_size);
    const int64_t real = std::clamp<int64_t>(
        static_cast<int64_t>(plan.windows.size()) - static_cast<int64_t>(first), 0, o.batch_size);
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
    const auto& split = model->tensor_parallel;
    const at::Tensor per_token =
        split && split->size() > 1
            ? tp::vocab_parallel_token_losses(shifted, labels, split->group(), split->vocab_start())
            : torch::nn::functional::cross_entropy(
                  shifted, labels,
                  torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    loss_sum += per_token.to(torch::kDouble).sum().item<double>();
    tokens += real * (T - 1);
  }
  // Over the data-parallel group: the tensor-parallel ranks of one hold the same losses.
  const double total_loss = allreduce(loss_sum, "sum", dp);
  const int64_t total_tokens = allreduce(tokens, "sum", dp);
  const double mean = total_loss / static_cast<double>(total_tokens);
  const double perplexity = std::exp(mean);
  char line[256];
  std::snprintf(line, sizeof(line),
                "mdist eval: loss %.6f nats/token, perplexity %.6f, %lld tokens predicted", mean,
                perplexity, static_cast<long long>(total_tokens));
  say(line);
  if (o.out && rank() == 0) {
    const nlohmann::json result = {
        {"model", choice.description}, {"data", data.description}, {"seq_len", T},
        {"tokens", total_tokens},      {"loss_sum", total_loss},   {"loss", mean},
        {"perplexity", perplexity}};
    hf::write_file_atomically(*o.out, result.dump(2) + "\n");
  }
  return 0;
}

}  // namespace mdist::cli
