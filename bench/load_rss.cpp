// Peak resident memory per rank while loading a Hugging Face checkpoint into a sharded model:
// hf::load_pretrained_fsdp2 (built on the meta device, each rank reading only its rows from
// the mmap'd safetensors) against a plain full load (hf::load_pretrained on every rank, then
// fsdp2_wrap). Run through mdistrun; bench/load_rss.sh writes the checkpoint, runs both on 1,
// 2 and 4 ranks and prints the table.
//     load_rss write DIR          build the model of DIR/config.json (random) and save it there
//     load_rss fsdp2|full DIR     load DIR on every rank; rank 0 prints one JSON line
// The peak is VmHWM restarted (clear_refs) just before loading, so it covers the load only;
// the baseline is VmRSS at that moment (libtorch, the process group). Touched pages of the
// memory-mapped checkpoint count as resident, which shows that each rank reads only its rows.
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "bench/json_line.h"
#include "bench/peak_rss.h"
#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/hf/pretrained.h"
#include "mdist/mdist.h"

namespace {

int64_t param_bytes(const torch::nn::Module& module) {
  int64_t total = 0;
  for (const auto& p : module.parameters()) total += p.numel() * p.element_size();
  return total;
}

int64_t checkpoint_bytes(const std::filesystem::path& dir) {
  int64_t total = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() == ".safetensors") {
      total += static_cast<int64_t>(entry.file_size());
    }
  }
  return total;
}

int write_checkpoint(const std::filesystem::path& dir) {
  const auto config = mdist::hf::LlamaConfig::from_file((dir / "config.json").string());
  torch::manual_seed(0);
  mdist::hf::CausalLM model(config);
  mdist::hf::save_pretrained(model, dir);
  std::cerr << "load_rss: wrote " << param_bytes(*model) / (1024 * 1024) << " MiB of fp32 "
            << "parameters to " << dir << "\n";
  return 0;
}

int load(const std::string& mode, const std::filesystem::path& dir) {
  const mdist::Session session;
  // The model's sizes, from a model without storage (costs nothing).
  const auto config = mdist::hf::LlamaConfig::from_file((dir / "config.json").string());
  int64_t total_bytes = 0, layer_bytes = 0;
  {
    const mdist::hf::CausalLM shape(config, c10::kMeta);
    total_bytes = param_bytes(*shape);
    layer_bytes = param_bytes(*shape->model->decoder_layers.at(0));
  }
  mdist::barrier();
  const double baseline = mdist::bench::rss_mib();
  const bool reset = mdist::bench::reset_peak_rss();
  const auto start = std::chrono::steady_clock::now();
  mdist::hf::CausalLM model{nullptr};
  if (mode == "fsdp2") {
    model = mdist::hf::load_pretrained_fsdp2(dir).model;
  } else {
    model = mdist::hf::load_pretrained(dir);
    mdist::fsdp2_wrap(*model);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double peak = mdist::bench::peak_rss_mib();
  const double after = mdist::bench::rss_mib();

  // Both loads must give the same model: a checksum of every rank's shards (padding is zero).
  double local_sum = 0;
  {
    const at::NoGradGuard no_grad;
    for (const auto& p : model->parameters()) local_sum += p.to(at::kDouble).sum().item<double>();
  }
  const double checksum = mdist::allreduce(local_sum, "sum");
  const auto per_rank =
      mdist::allgather(std::vector<double>{baseline, peak, after, seconds, reset ? 1.0 : 0.0});
  if (mdist::is_master()) {
    std::vector<double> baselines, peaks, afters;
    double slowest = 0;
    bool all_reset = true;
    for (const auto& r : per_rank) {
      baselines.push_back(r[0]);
      peaks.push_back(r[1]);
      afters.push_back(r[2]);
      slowest = std::max(slowest, r[3]);
      all_reset = all_reset && r[4] != 0;
    }
    mdist::bench::JsonLine()
        .add("mode", mode)
        .add("world", mdist::size())
        .add("param_bytes", total_bytes)
        .add("layer_bytes", layer_bytes)
        .add("checkpoint_bytes", checkpoint_bytes(dir))
        .add("baseline_mib", baselines)
        .add("peak_mib", peaks)
        .add("after_mib", afters)
        .add("load_s", slowest)
        .add("peak_reset", all_reset ? 1 : 0)
        .add("checksum", checksum)
        .print();
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return mdist::guarded_main(
      [](int count, char** args) {
        const std::string mode = count == 3 ? args[1] : "";
        if (mode == "write") return write_checkpoint(args[2]);
        if (mode == "fsdp2" || mode == "full") return load(mode, args[2]);
        std::cerr << "usage: load_rss write|fsdp2|full DIR\n";
        return 2;
      },
      argc, argv);
}
