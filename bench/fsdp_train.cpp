// FSDP training benchmark: the Llama-shaped stack of bench/llama_stack.h with every decoder
// layer and then the root wrapped by mdist::fully_shard, fp32, AdamW, trained on synthetic
// tokens (the global batch split over the ranks). Rank 0 prints one JSON line: median step
// time (and its forward, backward and optimizer parts), tokens/s, peak RSS and persistent
// bytes (shards + gradients + AdamW state) per rank, and the most units holding full
// parameters at once. Run through mdistrun; bench/fsdp_train.sh runs it beside PyTorch's
// fully_shard (bench/fsdp_train.py).
//     fsdp_train [timed_steps=8] [warmup=3] [global_batch=4] [seq_len=128] [compute]
// `compute` runs the same steps' forward + backward without fully_shard or optimizer and
// prints only their median time (the compute part of the profile).
// The roofline beside it: this machine's single-thread GEMM rate (in the compute dtype) on the
// model's matmul shapes (rank 0 alone), the loopback all-gather bandwidth, the model's FLOPs per
// step, and a per-phase profile of the step: the same model's forward + backward without
// fully_shard (compute, from the `compute` mode's separate run), the time blocked on collectives
// (communication not hidden, from FsdpHandle::communication()), the optimizer, and the rest
// (fully_shard's own work). FSDP_BENCH_ADAMW=plain steps torch::optim::AdamW instead of
// mdist::optim::FusedAdamW. FSDP_BENCH_DEVICE=cuda computes on cuda:LOCAL_RANK (NCCL for the
// collectives; a CUDA build, scripts/gpu_check.sh); FSDP_BENCH_PARAM_DTYPE=bf16 gathers and
// computes in bf16 with fp32 gradient reduction (MixedPrecisionPolicy), as the Python side does
// with the same variables.
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include "bench/json_line.h"
#include "bench/llama_stack.h"
#include "bench/peak_rss.h"
#include "bench/step_timing.h"
#include "bench/unshard_watch.h"
#include "mdist/fsdp/fully_shard.h"
#include "mdist/mdist.h"
#include "mdist/optim/fused_adamw.h"
#include "mdist/runtime/c10d.h"

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
  kCommWait,
  kGatherBytes,
  kReduceBytes,
  kBandwidth,
  kMainCpu,
  kOtherCpu,
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

// Median seconds of `repeats` calls of `fn` after one warm-up call.
template <typename Fn>
double time_median(int repeats, Fn&& fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    t.push_back(seconds(start, std::chrono::steady_clock::now()));
  }
  return median(t);
}

// GEMM FLOP/s of one thread on the model's matmul shapes ([tokens, in] x [in, out], each
// weight once, as a forward runs them) in the compute dtype (fp32, or bf16 under
// FSDP_BENCH_PARAM_DTYPE=bf16): the rate the step's matmuls could reach at best.
double gemm_flops_per_s(int64_t tokens, const c10::Device& device, c10::ScalarType dtype) {
  using C = mdist::bench::LlamaConfig;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {C::kDim, C::kDim},          {C::kDim, C::kDim},          {C::kDim, C::kDim},
      {C::kDim, C::kDim},          {C::kDim, C::kIntermediate}, {C::kDim, C::kIntermediate},
      {C::kIntermediate, C::kDim}, {C::kDim, C::kVocab}};
  double flops = 0, time = 0;
  for (const auto& [in, out] : shapes) {
    const at::Tensor a = torch::randn({tokens, in}, torch::device(device).dtype(dtype));
    const at::Tensor b = torch::randn({in, out}, torch::device(device).dtype(dtype));
    time += time_median(5, [&] {
      static_cast<void>(at::mm(a, b));
      if (device.is_cuda()) torch::cuda::synchronize();
    });
    flops += 2.0 * static_cast<double>(tokens * in * out);
  }
  return flops / time;
}

// Bytes per second one rank receives in an all-gather of `numel` floats per rank (loopback:
// every rank on this machine), the size of one decoder layer's gather.
double all_gather_bandwidth(int64_t numel, int world, const c10::Device& device) {
  const at::Tensor input = torch::randn({numel}, torch::device(device));
  at::Tensor output = torch::empty({world * numel}, torch::device(device));
  const auto pg = mdist::process_group(mdist::Group::world());
  const double t = time_median(5, [&] {
    at::Tensor in = input;
    mdist::wait(pg->all_gather_single(output, in), mdist::Group::world(), "bench all-gather");
  });
  return static_cast<double>((world - 1) * numel * 4) / t;
}

// CPU seconds (user + system) this process's threads have used so far: the main thread's
// (compute, copies, hooks) and all others' (Gloo's communication threads: loopback copies
// and the reduce-scatter's sums, which take cores from compute on this machine).
struct ThreadCpu {
  double main = 0, others = 0;
};
ThreadCpu thread_cpu_seconds() {
  ThreadCpu cpu;
  const std::string self = std::to_string(::getpid());
  const double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    // Fields after the command name (which may hold spaces) in parentheses: utime and stime
    // are the 12th and 13th of them.
    const auto close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(line.substr(close + 2));
    std::string field;
    double ticks = 0;
    for (int i = 1; i <= 13 && fields >> field; ++i) {
      if (i >= 12) ticks += std::stod(field);
    }
    (entry.path().filename() == self ? cpu.main : cpu.others) += ticks / tick;
  }
  return cpu;
}

double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }
double min_of(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

int bench(int argc, char** argv) {
  const int timed = argc > 1 ? std::atoi(argv[1]) : 8;
  const int warmup = argc > 2 ? std::atoi(argv[2]) : 3;
  const int64_t global_batch = argc > 3 ? std::atoll(argv[3]) : 4;
  const int64_t seq_len = argc > 4 ? std::atoll(argv[4]) : 128;
  const bool compute_only = argc > 5 && std::string(argv[5]) == "compute";
  if (timed < 1 || warmup < 0 || global_batch < 1 || seq_len < 2 || (argc > 5 && !compute_only)) {
    throw mdist::Error(
        "usage: fsdp_train [timed_steps>=1] [warmup>=0] [global_batch>=1] [seq_len>=2] "
        "[compute]");
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

  if (compute_only) {
    // The same forward + backward without fully_shard, every rank at once as in the training
    // steps (bench/fsdp_train.sh runs this mode beside each training run): the compute part
    // of a step, in the dtype the training steps compute in. Gradients are dropped; the
    // weights do not change.
    if (const auto dtype = bench_param_dtype()) model->to(*dtype);
    std::vector<double> compute_times;
    for (int step = 0; step < warmup + timed; ++step) {
      const auto cpu_batch = mdist::bench::batch_tokens(step, rank * per_rank, per_rank, seq_len);
      const at::Tensor inputs = cpu_batch.inputs.to(device);
      const at::Tensor targets = cpu_batch.targets.to(device);
      sync();
      const auto start = std::chrono::steady_clock::now();
      const at::Tensor logits = model->forward(inputs);
      at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}))
          .backward();
      sync();
      if (step >= warmup) compute_times.push_back(seconds(start, std::chrono::steady_clock::now()));
      for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    }
    const auto all = mdist::allgather(median(compute_times));
    if (mdist::is_master()) {
      mdist::bench::JsonLine()
          .add("impl", "compute only")
          .add("world", world)
          .add("compute_s", max_of(all))
          .print();
    }
    return 0;
  }
  // Rank 0 alone, so that the rate is one thread's on an otherwise idle core.
  double gemm_rate = 0;
  if (rank == 0) {
    gemm_rate =
        gemm_flops_per_s(per_rank * seq_len, device, bench_param_dtype().value_or(torch::kFloat32));
  }
  mdist::barrier();
  int64_t layer_numel = 0;
  for (const auto& p : model->decoder_layers.front()->parameters()) layer_numel += p.numel();
  const double bandwidth =
      world > 1 ? all_gather_bandwidth((layer_numel + world - 1) / world, world, device) : 0.0;

  mdist::bench::UnshardWatch watch;
  mdist::FullyShardOptions options;
  options.reshard_after_forward = true;
  options.mp_policy.param_dtype = bench_param_dtype();
  if (options.mp_policy.param_dtype) options.mp_policy.reduce_dtype = torch::kFloat32;
  int64_t layer_bytes = 0;
  std::vector<mdist::FsdpHandle> units;
  for (const auto& layer : model->decoder_layers) {
    const int64_t bytes = param_bytes(*layer);
    layer_bytes += bytes;
    units.push_back(mdist::fully_shard(*layer, options));
    watch.add_layer(units.back(), bytes);
  }
  units.push_back(mdist::fully_shard(*model, options));
  watch.add_root(units.back(), full_bytes - layer_bytes);
  for (const auto& layer : model->decoder_layers) watch.attach(*layer);

  const char* adamw_kind = std::getenv("FSDP_BENCH_ADAMW");
  const bool fused = adamw_kind == nullptr || std::string(adamw_kind) == "fused";
  if (!fused && std::string(adamw_kind) != "plain") {
    throw mdist::Error(std::string("bench: FSDP_BENCH_ADAMW is fused or plain, not ") + adamw_kind);
  }
  std::unique_ptr<torch::optim::AdamW> optimizer_ptr =
      fused ? std::make_unique<mdist::optim::FusedAdamW>(model->parameters(),
                                                         torch::optim::AdamWOptions(1e-3))
            : std::make_unique<torch::optim::AdamW>(model->parameters(),
                                                    torch::optim::AdamWOptions(1e-3));
  torch::optim::AdamW& optimizer = *optimizer_ptr;
  std::vector<double> losses;
  StepTimes times;
  ThreadCpu cpu_at_warmup;
  int64_t persistent = 0;
  for (int step = 0; step < warmup + timed; ++step) {
    const auto cpu_batch = mdist::bench::batch_tokens(step, rank * per_rank, per_rank, seq_len);
    const mdist::bench::TokenBatch batch{cpu_batch.inputs.to(device), cpu_batch.targets.to(device)};
    if (step == warmup) {
      for (auto& unit : units) unit.reset_communication();
      cpu_at_warmup = thread_cpu_seconds();
    }
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
  mdist::FsdpCommStats comm;
  for (const auto& unit : units) {
    const auto c = unit.communication();
    comm.wait_s += c.wait_s;
    comm.all_gather_bytes += c.all_gather_bytes;
    comm.reduce_scatter_bytes += c.reduce_scatter_bytes + c.all_reduce_bytes;
  }
  mine[kCommWait] = comm.wait_s / timed;
  mine[kGatherBytes] = static_cast<double>(comm.all_gather_bytes) / timed;
  mine[kReduceBytes] = static_cast<double>(comm.reduce_scatter_bytes) / timed;
  mine[kBandwidth] = bandwidth;
  const ThreadCpu cpu_at_end = thread_cpu_seconds();
  mine[kMainCpu] = (cpu_at_end.main - cpu_at_warmup.main) / timed;
  mine[kOtherCpu] = (cpu_at_end.others - cpu_at_warmup.others) / timed;
  const auto ranks = mdist::allgather(mine);
  const auto rank_losses = mdist::allgather(losses);
  if (!mdist::is_master()) return 0;

  // Every rank's loss is the mean over its equal share of the batch: their mean is the
  // global batch's loss.
  std::vector<double> mean_losses(losses.size(), 0.0);
  for (const auto& l : rank_losses) {
    for (std::size_t i = 0; i < l.size(); ++i) mean_losses[i] += l[i] / world;
  }
  // Analytic traffic: every unit gathered twice per step (before its forward and again before
  // its backward, resharded after forward) and its gradients reduce-scattered once, each
  // buffer world x the padded per-rank chunk (+ one flag per parameter in the reduction).
  double analytic_gather = 0, analytic_reduce = 0;
  for (const auto& unit : units) {
    double chunk = 0, count = 0;
    for (const auto& name : unit.managed_parameter_names()) {
      double numel = 1;
      for (const int64_t n : unit.shard_shape(name)) numel *= static_cast<double>(n);
      chunk += numel;
      ++count;
    }
    if (world > 1) {
      analytic_gather += 2.0 * world * chunk * 4;
      analytic_reduce += world * (chunk + count) * 4;
    }
  }
  // Model FLOPs per step: 6 x matmul parameters x tokens (forward 2, backward 4) plus the
  // attention scores and their weighted sum (4 B T^2 d per layer forward, x3 with backward).
  double matmul_params = 0;
  for (const auto& item : model->named_parameters()) {
    if (item.value().dim() == 2 && item.key().find("embed") == std::string::npos) {
      matmul_params += static_cast<double>(item.value().numel()) * world;  // shards: x world
    }
  }
  using C = mdist::bench::LlamaConfig;
  const double attention_flops = 12.0 * static_cast<double>(global_batch) *
                                 static_cast<double>(seq_len * seq_len) * C::kDim *
                                 static_cast<double>(model->decoder_layers.size());
  const double model_flops =
      6.0 * matmul_params * static_cast<double>(global_batch * seq_len) + attention_flops;
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
      .add("adamw", fused ? "mdist::optim::FusedAdamW" : "torch::optim::AdamW")
      .add("cores", static_cast<int64_t>(std::thread::hardware_concurrency()))
      .add("gemm_gflops_1thread", gemm_rate / 1e9)
      .add("model_gflop_per_step", model_flops / 1e9)
      .add("comm_wait_s", max_of(column(ranks, kCommWait)))
      .add("gather_bytes_per_rank", ranks[0][kGatherBytes])
      .add("reduce_bytes_per_rank", ranks[0][kReduceBytes])
      .add("analytic_gather_bytes", analytic_gather)
      .add("analytic_reduce_bytes", analytic_reduce)
      .add("all_gather_bytes_per_s", min_of(column(ranks, kBandwidth)))
      .add("main_thread_cpu_s", max_of(column(ranks, kMainCpu)))
      .add("other_threads_cpu_s", max_of(column(ranks, kOtherCpu)))
      .add("first_loss", mean_losses.front())
      .add("last_loss", mean_losses.back())
      .print();
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return mdist::guarded_main(bench, argc, argv); }
