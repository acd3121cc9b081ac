// Generation speed of mdist::hf::generate (KV cache, greedy, batch 1) on one thread: the model
// directory bench/generate.py wrote (save_pretrained), a prompt of PROMPT ids, NEW new tokens.
// Prints one JSON line: tokens/s over the whole call (prefill included) and the mean time of a
// decoding step at each context length bucket (steps [L - 32, L) for L in 64, 128, 256, ...):
// with the cache the step time stays flat as the sequence grows.
//     generate_bench MODEL_DIR [PROMPT=16] [NEW=256]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/json_line.h"
#include "mdist/hf/generate.h"
#include "mdist/hf/pretrained.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: generate_bench MODEL_DIR [PROMPT=16] [NEW=256]\n");
    return 2;
  }
  at::set_num_threads(1);
  const int64_t prompt_length = argc > 2 ? std::atoll(argv[2]) : 16;
  const int64_t new_tokens = argc > 3 ? std::atoll(argv[3]) : 256;
  mdist::hf::CausalLM model = mdist::hf::load_pretrained(argv[1]);
  model->eval();
  std::vector<int64_t> prompt;  // the same ids as bench/generate.py
  for (int64_t i = 0; i < prompt_length; ++i)
    prompt.push_back((7 * i + 3) % model->config.vocab_size);

  using Clock = std::chrono::steady_clock;
  std::vector<Clock::time_point> stamps;
  mdist::hf::GenerationOptions options;  // greedy, no end-of-sequence stop
  options.max_new_tokens = new_tokens;
  options.on_step = [&](const std::vector<int64_t>&, const std::vector<bool>&) {
    stamps.push_back(Clock::now());
  };
  options.max_new_tokens = 8;  // warm-up
  mdist::hf::generate(model, {prompt}, options);
  options.max_new_tokens = new_tokens;
  stamps.clear();
  const auto begin = Clock::now();
  const auto out = mdist::hf::generate(model, {prompt}, options);
  const double seconds = std::chrono::duration<double>(Clock::now() - begin).count();

  mdist::bench::JsonLine line;
  line.add("impl", "mdist").add("tokens_per_s", static_cast<double>(out.front().size()) / seconds);
  // stamps[i]: token i + 1 chosen; the step between stamps[i - 1] and stamps[i] ran a forward
  // over a context of prompt_length + i tokens.
  for (int64_t length = 64; length <= prompt_length + new_tokens; length *= 2) {
    double total = 0;
    int count = 0;
    for (int64_t i = std::max<int64_t>(1, length - 32 - prompt_length);
         i < length - prompt_length && i < static_cast<int64_t>(stamps.size()); ++i) {
      total += std::chrono::duration<double, std::milli>(stamps[i] - stamps[i - 1]).count();
      ++count;
    }
    if (count > 0) line.add("step_ms_" + std::to_string(length), total / count);
  }
  line.print();
  return 0;
}
