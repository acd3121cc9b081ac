// `mdist generate`: samples bytes from a byte-level causal LM (greedy, temperature, top-k).
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <iostream>

#include "mdist/hf/tensor_parallel.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"
#include "src/cli/commands.h"
#include "src/cli/job.h"

namespace mdist::cli {

int run_generate(const GenerateOptions& o) {
  const Session session(setup_options(o.timeout_s));
  configure_threads();
  ModelChoice choice;
  std::optional<MixedPrecisionPolicy> mp_policy;
  agree_on_inputs([&] {
    mp_policy = parse_param_dtype(o.param_dtype);
    if (o.max_new_tokens < 0) throw InputError("--max-new-tokens must not be negative");
    if (!o.greedy && !(std::isfinite(o.temperature) && o.temperature > 0)) {
      throw InputError("--temperature must be a positive number (or use --greedy), got " +
                       flag_value(o.temperature));
    }
    if (o.top_k < 0) throw InputError("--top-k must not be negative (0: no limit)");
    if (o.prompt.empty()) throw InputError("--prompt must not be empty");
    check_tensor_parallel_size(o.tensor_parallel);
    choice = model_for_inference(o.model_dir, o.default_run);
    check_tensor_parallel(o.tensor_parallel, choice.config);
    if (!choice.tokenizer && choice.config.vocab_size < 256) {
      throw InputError("generate needs a byte-level model (vocab_size >= 256); this one has " +
                       std::to_string(choice.config.vocab_size));
    }
  });
  const JobLayout layout = make_layout(o.tensor_parallel);
  const hf::ParallelModel built = build_wrapped_model(choice, o.seed, layout, mp_policy);
  hf::CausalLM model = built.model;
  // A quantized checkpoint samples as its quantized model (inputs fake-quantized).
  const auto quantizers = checkpoint_quantizers(choice, model);
  model->eval();
  const torch::NoGradGuard no_grad;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  const c10::Device device = compute_device();
  say("mdist generate: model " + choice.description);
  if (mp_policy) say("mdist generate: " + describe_mixed_precision(*mp_policy, model));
  say("mdist generate: " + tokenizer_line(choice));

  // With a tokenizer the prompt is encoded (with its special tokens, as a prompt is in
  // transformers) and the output decoded; without one every byte is a token.
  std::vector<int64_t> tokens;
  if (choice.tokenizer) {
    for (const std::int32_t id : choice.tokenizer->encode(o.prompt, true)) tokens.push_back(id);
  } else {
    for (const char c : o.prompt) tokens.push_back(static_cast<unsigned char>(c));
  }
  const std::size_t prompt_tokens = tokens.size();
  std::string printed;  // the decoded continuation shown so far
  if (rank() == 0) {
    std::cout << "----\n" << o.prompt << std::flush;
  }
  const auto window = static_cast<std::size_t>(choice.config.max_position_embeddings);
  for (int i = 0; i < o.max_new_tokens; ++i) {
    // No KV cache: the whole (truncated) context each time; fine for the small byte models.
    const std::size_t start = tokens.size() > window ? tokens.size() - window : 0;
    const auto context =
        torch::tensor(
            std::vector<int64_t>(tokens.begin() + static_cast<std::ptrdiff_t>(start), tokens.end()))
            .unsqueeze(0)
            .to(device);
    // Sampling on the CPU with a seeded CPU generator: the same bytes on any device.
    // Split over tensor-parallel ranks, only the last position's logits are gathered.
    at::Tensor logits = hf::full_logits(built.parallelism, model->forward(context).select(1, -1))
                            .squeeze(0)
                            .to(torch::kCPU, torch::kFloat);
    int64_t next = 0;
    if (o.greedy) {
      next = logits.argmax().item<int64_t>();
    } else {
      logits = logits / o.temperature;
      if (o.top_k > 0 && o.top_k < logits.size(0)) {
        const auto kth = std::get<0>(logits.topk(o.top_k)).min();
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
      }
      next = torch::multinomial(logits.softmax(0), 1, false, generator).item<int64_t>();
    }
    // Ranks compute the same logits; rank 0's choice is the one every rank continues with.
    next = broadcast(next);
    tokens.push_back(next);
    if (rank() != 0) continue;
    if (!choice.tokenizer) {
      std::cout << static_cast<char>(next) << std::flush;
      continue;
    }
    // Decoding the whole continuation each time: a token can complete a character (or drop a
    // leading space) only in the context of the tokens before it. A trailing U+FFFD (bytes of
    // a character still incomplete, with byte fallback) is held back until the next token
    // completes it; what grows the printed text is printed.
    const std::vector<std::int32_t> continuation(
        tokens.begin() + static_cast<std::ptrdiff_t>(prompt_tokens), tokens.end());
    std::string text = choice.tokenizer->decode(continuation, true);
    if (i + 1 < o.max_new_tokens) {
      constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
      while (text.ends_with(kReplacement)) text.resize(text.size() - kReplacement.size());
    }
    if (text.size() > printed.size() && text.compare(0, printed.size(), printed) == 0) {
      std::cout << text.substr(printed.size()) << std::flush;
      printed = text;
    }
  }
  if (rank() == 0) std::cout << "\n----" << std::endl;
  return 0;
}

}  // namespace mdist::cli
