// See mdist/train/evaluate.h.
#include "mdist/train/evaluate.h"

#include <torch/torch.h>

#include <algorithm>

#include "mdist/objects/collectives.h"
#include "mdist/runtime/device.h"
#include "mdist/runtime/runtime.h"
#include "mdist/tp/cross_entropy.h"
#include "mdist/train/forward_split.h"

namespace mdist::train {

HeldOutLoss held_out_loss(hf::CausalLM& model, const hf::Parallelism& parallelism,
                          const SequenceSource& data, const ParallelState& parallel,
                          std::int64_t batch_size, std::int64_t max_sequences) {
  const bool training = model->is_training();
  model->eval();
  const torch::NoGradGuard no_grad;
  const int64_t total = max_sequences > 0 ? std::min(max_sequences, data.count) : data.count;
  const auto plan = plan_forwards(total, mdist::size(parallel.data_parallel_group.group()),
                                  mdist::rank(parallel.data_parallel_group.group()), batch_size);
  const int64_t T = data.length;
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
    const Batch batch = data.rows(which).to(compute_device());
    const at::Tensor logits = model->forward(batch.ids, batch.attention_mask, batch.position_ids);
    if (real == 0) continue;
    // Per-token losses summed in double: the total must not depend on how the sequences were
    // grouped into batches and ranks. Labels of -100 (a prompt, padding) add 0 and no token.
    const auto V = logits.size(-1);
    const at::Tensor shifted = logits.narrow(1, 0, T - 1).reshape({-1, V}).to(torch::kFloat);
    const at::Tensor labels = batch.targets().narrow(1, 1, T - 1).reshape({-1});
    const auto& split = parallelism.tensor_parallel;
    const at::Tensor per_token =
        parallelism.tensor_parallel_split()
            ? tp::vocab_parallel_token_losses(shifted, labels, split->group(), split->vocab_start(),
                                              -100, split->counters())
            : torch::nn::functional::cross_entropy(shifted, labels,
                                                   torch::nn::functional::CrossEntropyFuncOptions()
                                                       .reduction(torch::kNone)
                                                       .ignore_index(-100));
    loss_sum += per_token.to(torch::kDouble).sum().item<double>();
    tokens += predicted_tokens(batch);
  }
  if (training) model->train();
  // Over the data-parallel group: the tensor-parallel ranks of one hold the same losses.
  const Group dp = parallel.data_parallel_group.group();
  return {allreduce(loss_sum, "sum", dp), allreduce(tokens, "sum", dp)};
}

}  // namespace mdist::train
