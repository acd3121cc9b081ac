// Tensor parallelism + FSDP2 training benchmark: mdist::hf::CausalLM in the shape of
// bench/llama_stack.h (vocab 256, hidden 512, 8 layers, 8 heads, SwiGLU 1536, untied head),
// split over a tensor-parallel group by hf::parallelize (Megatron-style: column-parallel
// q/k/v/gate/up, row-parallel o/down, vocab-parallel embedding and lm_head with the
// vocab-parallel cross entropy), then sharded over the data-parallel group by fsdp2_wrap
// (each decoder layer, then the root), fp32, AdamW, trained on the synthetic tokens of
// bench/llama_stack.h (the global batch split over the data-parallel ranks; every
// tensor-parallel rank of a data-parallel group sees the same tokens). The weights start from
// bench/llama_stack.h's init_weights under the same names (without CausalLM's "model."
// prefix), so bench/tp_train.py (PyTorch's own TP + FSDP2) starts from the same values.
// Rank 0 prints one JSON line: median step time and its forward (with the loss), backward
// and optimizer parts, peak RSS per rank, and the bytes each rank sent into the
// tensor-parallel all-reduces per step beside the analytic count. Run through mdistrun;
// bench/tp_train.sh runs it beside bench/tp_train.py.
//     tp_train [tensor_parallel=2] [timed_steps=8] [warmup=3] [global_batch=4] [seq_len=128]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/json_line.h"
#include "bench/llama_stack.h"
#include "bench/peak_rss.h"
#include "bench/step_timing.h"
#include "mdist/groups/parallel_state.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/hf/config.h"
#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/mdist.h"
#include "mdist/optim/fused_adamw.h"
#include "mdist/tp/collectives.h"

namespace {

using Shape = mdist::bench::LlamaConfig;

mdist::hf::LlamaConfig bench_config() {
  mdist::hf::LlamaConfig config;
  config.architecture = "LlamaForCausalLM";
  config.architectures = {"LlamaForCausalLM"};
  config.model_type = "llama";
  config.vocab_size = Shape::kVocab;
  config.hidden_size = Shape::kDim;
  config.num_hidden_layers = Shape::kLayers;
  config.num_attention_heads = Shape::kHeads;
  config.num_key_value_heads = Shape::kHeads;
  config.head_dim = Shape::kHeadDim;
  config.intermediate_size = Shape::kIntermediate;
  config.rms_norm_eps = Shape::kNormEps;
  config.rope_theta = Shape::kRopeTheta;
  config.tie_word_embeddings = false;
  config.qkv_bias = false;
  config.o_bias = false;
  config.mlp_bias = false;
  return config;
}

// bench/llama_stack.h's init_weights on CausalLM's names with the "model." prefix dropped
// (which are then llama_stack's names): parameter i in that name order is drawn after
// manual_seed(1000 + i), norm weights are ones, as the Python side does.
void init_weights(torch::nn::Module& model) {
  auto named = model.named_parameters().pairs();
  const auto stripped = [](const std::string& name) {
    return name.starts_with("model.") ? name.substr(6) : name;
  };
  std::sort(named.begin(), named.end(),
            [&](const auto& a, const auto& b) { return stripped(a.first) < stripped(b.first); });
  const at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < named.size(); ++i) {
    auto& [name, param] = named[i];
    if (name.ends_with("norm.weight")) {
      param.fill_(1.0);
    } else {
      torch::manual_seed(1000 + i);
      param.normal_(0.0, 0.02);
    }
  }
}

using mdist::bench::median;
using mdist::bench::seconds;

// What each rank sends rank 0: one vector, so that one all-gather carries it.
enum Metric : std::size_t {
  kStep,
  kForward,
  kBackward,
  kOptimizer,
  kPeakRss,
  kAllReduceBytes,  // per timed step
  kAllGatherBytes,  // per timed step
  kAnalyticBytes,
  kMetricCount,
};

std::vector<double> column(const std::vector<std::vector<double>>& ranks, Metric metric) {
  std::vector<double> out;
  for (const auto& r : ranks) out.push_back(r[metric]);
  return out;
}

double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

int bench(int argc, char** argv) {
  const int tensor_parallel = argc > 1 ? std::atoi(argv[1]) : 2;
  const int timed = argc > 2 ? std::atoi(argv[2]) : 8;
  const int warmup = argc > 3 ? std::atoi(argv[3]) : 3;
  const int64_t global_batch = argc > 4 ? std::atoll(argv[4]) : 4;
  const int64_t seq_len = argc > 5 ? std::atoll(argv[5]) : 128;
  if (tensor_parallel < 1 || timed < 1 || warmup < 0 || global_batch < 1 || seq_len < 2) {
    throw mdist::Error(
        "usage: tp_train [tensor_parallel>=1] [timed_steps>=1] [warmup>=0] [global_batch>=1] "
        "[seq_len>=2]");
  }

  const mdist::Session session;
  const int world = mdist::size();
  if (world % tensor_parallel != 0) {
    throw mdist::Error("bench: tensor parallel " + std::to_string(tensor_parallel) +
                       " does not divide the world of " + std::to_string(world) + " ranks");
  }
  const int data_parallel = world / tensor_parallel;
  if (global_batch % data_parallel != 0) {
    throw mdist::Error("bench: global batch " + std::to_string(global_batch) +
                       " does not split over " + std::to_string(data_parallel) +
                       " data-parallel ranks");
  }
  const int64_t per_rank = global_batch / data_parallel;

  const auto state = mdist::make_parallel_state({.tensor_parallel = tensor_parallel});
  const int dp_rank = data_parallel > 1 ? state.data_parallel_group.rank() : 0;

  const mdist::hf::LlamaConfig config = bench_config();
  mdist::hf::CausalLM model(config);
  init_weights(*model);
  int64_t param_count = 0;
  double checksum = 0;
  for (const auto& p : model->parameters()) {
    param_count += p.numel();
    checksum += p.to(torch::kFloat64).sum().item<double>();
  }

  const auto plan = mdist::hf::parallelize(model, state);
  mdist::fsdp2_wrap(*model, true, std::nullopt, false, state.data_parallel_group.group());

  // mdist's optimizer (the Python side steps torch.optim.AdamW with its defaults).
  mdist::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  std::vector<double> losses;
  std::vector<double> step_s, forward_s, backward_s, optimizer_s;
  for (int step = 0; step < warmup + timed; ++step) {
    if (step == warmup) plan->reset_communication();
    // HF's convention: labels are the inputs; the loss shifts them (seq_len - 1 targets).
    const at::Tensor ids =
        mdist::bench::batch_tokens(step, dp_rank * per_rank, per_rank, seq_len).inputs;
    const auto start = std::chrono::steady_clock::now();
    optimizer.zero_grad();
    const at::Tensor logits = model->forward(ids);
    const at::Tensor loss = plan->loss(logits, ids);
    const auto forward_done = std::chrono::steady_clock::now();
    loss.backward();
    const auto backward_done = std::chrono::steady_clock::now();
    optimizer.step();
    const auto stop = std::chrono::steady_clock::now();
    if (step >= warmup) {
      step_s.push_back(seconds(start, stop));
      forward_s.push_back(seconds(start, forward_done));
      backward_s.push_back(seconds(forward_done, backward_done));
      optimizer_s.push_back(seconds(backward_done, stop));
    }
    losses.push_back(loss.item<double>());
  }
  const mdist::tp::CommunicationBytes sent = plan->communication();

  // Per step per rank: forward 2 all-reduces per layer (after o_proj and down_proj) and the
  // vocab-parallel embedding's; backward 2 per layer (the gradients of the attention and MLP
  // inputs) and the lm_head input's; each [B, T, hidden] fp32. Plus the vocab-parallel cross
  // entropy: the row maxima, then the sums of exponentials and the target logits packed, over
  // B (T - 1) positions.
  const double analytic =
      tensor_parallel == 1
          ? 0.0
          : static_cast<double>((4 * Shape::kLayers + 2) * per_rank * seq_len * Shape::kDim * 4 +
                                3 * per_rank * (seq_len - 1) * 4);

  std::vector<double> mine(kMetricCount);
  mine[kStep] = median(step_s);
  mine[kForward] = median(forward_s);
  mine[kBackward] = median(backward_s);
  mine[kOptimizer] = median(optimizer_s);
  mine[kPeakRss] = mdist::bench::peak_rss_mib();
  mine[kAllReduceBytes] = static_cast<double>(sent.all_reduce) / timed;
  mine[kAllGatherBytes] = static_cast<double>(sent.all_gather) / timed;
  mine[kAnalyticBytes] = analytic;
  const auto ranks = mdist::allgather(mine);
  const auto rank_losses = mdist::allgather(losses);
  if (!mdist::is_master()) return 0;

  // Every rank's loss is its data-parallel group's (the same on its tensor-parallel ranks),
  // the mean over an equal share of the batch: their mean is the global batch's loss.
  std::vector<double> mean_losses(losses.size(), 0.0);
  for (const auto& l : rank_losses) {
    for (std::size_t i = 0; i < l.size(); ++i) mean_losses[i] += l[i] / world;
  }
  // The ranks run in lockstep; the slowest one's median is the job's step time.
  const double step = max_of(column(ranks, kStep));
  mdist::bench::JsonLine()
      .add("impl", "mdist (C++)")
      .add("world", world)
      .add("dp", data_parallel)
      .add("tp", tensor_parallel)
      .add("threads", at::get_num_threads())
      .add("params", param_count)
      .add("init_checksum", checksum)
      .add("global_batch", global_batch)
      .add("seq_len", seq_len)
      .add("warmup", warmup)
      .add("steps", timed)
      .add("step_s", step)
      .add("step_s_per_rank", column(ranks, kStep))
      .add("forward_s", max_of(column(ranks, kForward)))
      .add("backward_s", max_of(column(ranks, kBackward)))
      .add("optimizer_s", max_of(column(ranks, kOptimizer)))
      .add("tokens_per_s", static_cast<double>(global_batch * seq_len) / step)
      .add("peak_rss_mib", column(ranks, kPeakRss))
      .add("tp_all_reduce_bytes_per_step", column(ranks, kAllReduceBytes))
      .add("tp_all_gather_bytes_per_step", column(ranks, kAllGatherBytes))
      .add("tp_all_reduce_analytic_bytes", analytic)
      .add("first_loss", mean_losses.front())
      .add("last_loss", mean_losses.back())
      .print();
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mdist::guarded_main(bench, argc, argv); }
