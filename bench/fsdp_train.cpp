// FSDP training benchmark: the Llama-shaped stack of bench/llama_stack.h with every decoder
// layer and then the root wrapped by mdist::fully_shard, fp32, AdamW, trained on synthetic
// tokens (the global batch split over the ranks). Rank 0 prints one JSON line: median step
// time (and its forward, backward and optimizer parts), tokens/s, peak RSS and persistent
// bytes (shards + gradients + AdamW state) per rank, and the most units holding full
// parameters at once. Run through mdistrun; bench/fsdp_train.sh runs it beside PyTorch's
// fully_shard (bench/fsdp_train.py).
//     fsdp_train [timed_steps=8] [warmup=3] [global_batch=4] [seq_len=128]
// FSDP_BENCH_DEVICE=cuda computes on cuda:LOCAL_RANK (NCCL for the collectives; a CUDA build,
// scripts/gpu_check.sh); FSDP_BENCH_PARAM_DTYPE=bf16 gathers and computes in bf16 with fp32
// gradient reduction (MixedPrecisionPolicy), as the Python side does with the same variables.
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "bench/json_line.h"
#include "bench/llama_stack.h"
#include "bench/peak_rss.h"
#include "bench/step_timing.h"
#include "bench/unshard_watch.h"
#include "mdist/fsdp/fully_shard.h"
#include "mdist/mdist.h"

namespace {

using mdist::bench::LlamaStack;

constexpr double kMiB = 1024.0 * 1024.0;

int64_t nbytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

int64_t param_bytes(const torch::nn::Module& module) {
  int64_t total = 0;
  for (const auto& p : module.parameters()) total += nbytes(p);
  return total;
}

// What this rank holds between steps: its shards, their gradients and the AdamW state.
int64_t persistent_bytes(torch::nn::Module& model, torch::optim::AdamW& optimizer) {
  int64_t total = 0;
  for (const auto& p : model.parameters()) total += nbytes(p) + nbytes(p.grad());
  for (const auto& [key, state] : optimizer.state()) {
    const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state.get());
    if (adamw == nullptr) throw mdist::Error("bench: optimizer state is not AdamWParamState");
    total +=
        nbytes(adamw->exp_avg()) + nbytes(adamw->exp_avg_sq()) + nbytes(adamw->max_exp_avg_sq());
  }
  return total;
}

// Per-step durations (seconds) of the timed steps.
struct StepTimes {
  std::vector<double> step, forward, backward, optimizer;
};

using mdist::bench::median;
using mdist::bench::seconds;

// What each rank sends rank 0: one vector, so that one all-gather carries it.
enum Metric : std::size_t {
  kStep,
  kForward,
  kBackward,
  kOptimizer,
  kPeakRss,
  kPersistent,
  kUnits,
  kLayerUnits,
  kFullBytes,
  kProbeSamples,
  kMetricCount,
};

std::vector<double> column(const std::vector<std::vector<double>>& ranks, Metric metric) {
  std::vector<double> out;
  for (const auto& r : ranks) out.push_back(r[metric]);
  return out;
}

// The bench's device from FSDP_BENCH_DEVICE ("cpu", the default, or "cuda").
c10::Device bench_device() {
  const char* name = std::getenv("FSDP_BENCH_DEVICE");
  const std::string device = name == nullptr ? "cpu" : name;
  if (device == "cpu") return c10::Device(c10::kCPU);
  if (device != "cuda")
    throw mdist::Error("bench: FSDP_BENCH_DEVICE is cpu or cuda, not " + device);
  if (!torch::cuda::is_available())
    throw mdist::Error("bench: FSDP_BENCH_DEVICE=cuda but no CUDA device");
  return mdist::compute_device();
}

std::optional<c10::ScalarType> bench_param_dtype() {
  const char* name = std::getenv("FSDP_BENCH_PARAM_DTYPE");
  if (name == nullptr || std::string(name) == "fp32") return std::nullopt;
  if (std::string(name) == "bf16") return torch::kBFloat16;
  throw mdist::Error(std::string("bench: FSDP_BENCH_PARAM_DTYPE is fp32 or bf16, not ") + name);
}

double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }
double min_of(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

int bench(int argc, char** argv) {
  const int timed = argc > 1 ? std::atoi(argv[1]) : 8;
  const int warmup = argc > 2 ? std::atoi(argv[2]) : 3;
  const int64_t global_batch = argc > 3 ? std::atoll(argv[3]) : 4;
  const int64_t seq_len = argc > 4 ? std::atoll(argv[4]) : 128;
  if (timed < 1 || warmup < 0 || global_batch < 1 || seq_len < 2) {
    throw mdist::Error(
        "usage: fsdp_train [timed_steps>=1] [warmup>=0] [global_batch>=1] [seq_len>=2]");
  }

  const mdist::Session session;
  const int world = mdist::size();
  const int rank = mdist::rank();
  if (global_batch % world != 0) {
    throw mdist::Error("bench: global batch " + std::to_string(global_batch) +
                       " does not split over " + std::to_string(world) + " ranks");
  }
  const int64_t per_rank = global_batch / world;

  const c10::Device device = bench_device();
  // Kernels are asynchronous on CUDA: phase boundaries wait for them, or the times would
  // measure only the launches.
  const auto sync = [&device] {
    if (device.is_cuda()) torch::cuda::synchronize();
  };
  LlamaStack model;
  mdist::bench::init_weights(*model);
  model->to(device);
  int64_t param_count = 0, full_bytes = 0, pad_bytes = 0;
  double checksum = 0;
  for (const auto& p : model->parameters()) {
    param_count += p.numel();
    full_bytes += nbytes(p);
    checksum += p.to(torch::kFloat64).sum().item<double>();
    // Bytes a rank may carry beyond total / W: dim 0 is cut into chunks rounded up.
    const int64_t rows = p.size(0), chunk = (rows + world - 1) / world;
    pad_bytes += (chunk * world - rows) * (p.numel() / rows) * p.element_size();
  }

  mdist::bench::UnshardWatch watch;
  mdist::FullyShardOptions options;
  options.reshard_after_forward = true;
  options.mp_policy.param_dtype = bench_param_dtype();
  if (options.mp_policy.param_dtype) options.mp_policy.reduce_dtype = torch::kFloat32;
  int64_t layer_bytes = 0;
  for (const auto& layer : model->decoder_layers) {
    const int64_t bytes = param_bytes(*layer);
    layer_bytes += bytes;
    watch.add_layer(mdist::fully_shard(*layer, options), bytes);
  }
  watch.add_root(mdist::fully_shard(*model, options), full_bytes - layer_bytes);
  for (const auto& layer : model->decoder_layers) watch.attach(*layer);

  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  std::vector<double> losses;
  StepTimes times;
  int64_t persistent = 0;
  for (int step = 0; step < warmup + timed; ++step) {
    const auto cpu_batch = mdist::bench::batch_tokens(step, rank * per_rank, per_rank, seq_len);
    const mdist::bench::TokenBatch batch{cpu_batch.inputs.to(device), cpu_batch.targets.to(device)};
    sync();
    const auto start = std::chrono::steady_clock::now();
    optimizer.zero_grad();
    const at::Tensor logits = model->forward(batch.inputs);
    const at::Tensor loss = at::cross_entropy_loss(
        logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32), batch.targets.reshape({-1}));
    sync();
    const auto forward_done = std::chrono::steady_clock::now();
    loss.backward();
    sync();
    const auto backward_done = std::chrono::steady_clock::now();
    optimizer.step();
    sync();
    const auto stop = std::chrono::steady_clock::now();
    if (step >= warmup) {
      times.step.push_back(seconds(start, stop));
      times.forward.push_back(seconds(start, forward_done));
      times.backward.push_back(seconds(forward_done, backward_done));
      times.optimizer.push_back(seconds(backward_done, stop));
    }
    losses.push_back(loss.item<double>());
    // Gradients are still set here (zero_grad at the next step's start drops them).
    if (step == warmup + timed - 1) persistent = persistent_bytes(*model, optimizer);
  }

  std::vector<double> mine(kMetricCount);
  mine[kStep] = median(times.step);
  mine[kForward] = median(times.forward);
  mine[kBackward] = median(times.backward);
  mine[kOptimizer] = median(times.optimizer);
  mine[kPeakRss] = mdist::bench::peak_rss_mib();
  mine[kPersistent] = static_cast<double>(persistent);
  mine[kUnits] = watch.max_units;
  mine[kLayerUnits] = watch.max_layer_units;
  mine[kFullBytes] = static_cast<double>(watch.max_bytes);
  mine[kProbeSamples] = static_cast<double>(watch.backward_samples);
  const auto ranks = mdist::allgather(mine);
  const auto rank_losses = mdist::allgather(losses);
  if (!mdist::is_master()) return 0;

  // Every rank's loss is the mean over its equal share of the batch: their mean is the
  // global batch's loss.
  std::vector<double> mean_losses(losses.size(), 0.0);
  for (const auto& l : rank_losses) {
    for (std::size_t i = 0; i < l.size(); ++i) mean_losses[i] += l[i] / world;
  }
  // The ranks run in lockstep; the slowest one's median is the job's step time.
  const double step = max_of(column(ranks, kStep));
  const double tokens = static_cast<double>(global_batch * seq_len);
  mdist::bench::JsonLine()
      .add("impl", "mdist (C++)")
      .add("world", world)
      .add("device", device.str())
      .add("param_dtype", options.mp_policy.param_dtype ? "bf16" : "fp32")
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
      .add("tokens_per_s", tokens / step)
      .add("peak_rss_mib", column(ranks, kPeakRss))
      .add("persistent_bytes", column(ranks, kPersistent))
      // Parameters, gradients, exp_avg and exp_avg_sq: four times the parameter bytes.
      .add("persistent_expected_bytes", 4.0 * static_cast<double>(full_bytes) / world)
      .add("padding_allowance_bytes", 4.0 * static_cast<double>(pad_bytes) / world)
      .add("optimizer_state", "optimizer.state() AdamWParamState")
      .add("max_full_units", max_of(column(ranks, kUnits)))
      .add("max_full_layer_units", max_of(column(ranks, kLayerUnits)))
      .add("max_full_param_mib", max_of(column(ranks, kFullBytes)) / kMiB)
      .add("backward_probe_samples", min_of(column(ranks, kProbeSamples)))
      .add("first_loss", mean_losses.front())
      .add("last_loss", mean_losses.back())
      .print();
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mdist::guarded_main(bench, argc, argv); }
