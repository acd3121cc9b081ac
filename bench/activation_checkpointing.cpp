// One process, one mode: peak RSS and step time of training a ~134 M-parameter Llama-style
// model (random init, fp32, AdamW) with activation checkpointing `none` or `full`
// (bench/activation_checkpointing.sh alternates the modes and summarises).
//   activation_checkpointing MODE [BATCH SEQ STEPS]
// Prints one JSON line: the model's parameters, the resident size before the measured steps
// (weights, gradients, AdamW state: allocated by a first, unmeasured step), the peak during
// them and its difference (the activations' part), and each measured step's seconds.
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/json_line.h"
#include "bench/peak_rss.h"
#include "mdist/hf/activation_checkpointing.h"
#include "mdist/hf/causal_lm.h"

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const std::string mode = argv[1];
  const int64_t batch = argc > 2 ? std::atol(argv[2]) : 2;
  const int64_t seq = argc > 3 ? std::atol(argv[3]) : 512;
  const int steps = argc > 4 ? std::atoi(argv[4]) : 2;
  const auto config = mdist::hf::LlamaConfig::from_json(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 768,
    "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_key_value_heads": 12, "max_position_embeddings": 1024, "vocab_size": 32000,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false})");
  torch::manual_seed(0);
  mdist::hf::CausalLM model(config);
  mdist::hf::apply_activation_checkpointing(
      model, {.mode = mode == "full" ? mdist::hf::ActivationCheckpointingMode::kFull
                                     : mdist::hf::ActivationCheckpointingMode::kNone});
  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-4));
  const at::Tensor ids = torch::randint(0, config.vocab_size, {batch, seq});
  const auto step = [&] {
    // Zeroed in place, not freed: the gradients stay resident, so the peak above the
    // resident size before a step is what the step allocates on top (activations, mostly).
    optimizer.zero_grad(/*set_to_none=*/false);
    mdist::hf::causal_lm_loss(model->forward(ids), ids).backward();
    optimizer.step();
  };
  step();  // AdamW's state and the gradients exist from here on
  const bool reset = mdist::bench::reset_peak_rss();
  const double before = mdist::bench::rss_mib();
  std::vector<double> seconds;
  for (int i = 0; i < steps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    step();
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  const double peak = mdist::bench::peak_rss_mib();
  mdist::bench::JsonLine()
      .add("mode", mode)
      .add("parameters", parameters)
      .add("tokens", batch * seq)
      .add("peak_reset", reset ? 1 : 0)
      .add("rss_before_mib", before)
      .add("peak_mib", peak)
      .add("activation_mib", peak - before)
      .add("step_s", seconds)
      .print();
  return 0;
}
