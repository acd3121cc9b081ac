// `mdist generate`: continues prompts with a causal LM and its KV cache (mdist::hf::generate):
// greedy or sampled (temperature, top-k, top-p), several prompts as one left-padded batch.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "mdist/hf/generate.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"
#include "src/cli/commands.h"
#include "src/cli/job.h"

namespace mdist::cli {
namespace {

// --prompt values, then --prompts FILE's non-blank lines (a trailing \r dropped); the default
// prompt when neither is given.
std::vector<std::string> read_prompts(const GenerateOptions& o) {
  std::vector<std::string> prompts = o.prompts;
  for (const auto& prompt : prompts) {
    if (prompt.empty()) throw InputError("--prompt must not be empty");
  }
  if (o.prompts_file) {
    std::ifstream in(*o.prompts_file, std::ios::binary);
    if (!in) throw InputError("--prompts: cannot read '" + o.prompts_file->string() + "'");
    std::size_t lines = 0;
    for (std::string line; std::getline(in, line);) {
      if (line.ends_with('\r')) line.pop_back();
      if (!line.empty()) {
        prompts.push_back(line);
        ++lines;
      }
    }
    if (lines == 0) {
      throw InputError("--prompts: '" + o.prompts_file->string() + "' has no prompt");
    }
  }
  if (prompts.empty()) prompts.emplace_back(kDefaultPrompt);
  return prompts;
}

// With a tokenizer a prompt is encoded with its special tokens, as a prompt is in
// transformers; without one every byte is a token.
std::vector<int64_t> encode(const ModelChoice& choice, const std::string& text) {
  std::vector<int64_t> tokens;
  if (choice.tokenizer) {
    for (const std::int32_t id : choice.tokenizer->encode(text, true)) tokens.push_back(id);
  } else {
    for (const char c : text) tokens.push_back(static_cast<unsigned char>(c));
  }
  return tokens;
}

// Streams one row's continuation to stdout as its tokens come.
class Printer {
 public:
  explicit Printer(const ModelChoice& choice) : choice_(choice) {}
  // `last`: no token follows, so an incomplete character is printed as it is.
  void add(int64_t token, bool last) {
    tokens_.push_back(static_cast<std::int32_t>(token));
    if (!choice_.tokenizer) {
      std::cout << static_cast<char>(token) << std::flush;
      return;
    }
    // Decoding the whole continuation each time: a token can complete a character (or drop a
    // leading space) only in the context of the tokens before it. A trailing U+FFFD (bytes of
    // a character still incomplete, with byte fallback) is held back until the next token
    // completes it; what grows the printed text is printed.
    std::string text = choice_.tokenizer->decode(tokens_, true);
    if (!last) {
      constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
      while (text.ends_with(kReplacement)) text.resize(text.size() - kReplacement.size());
    }
    if (text.size() > printed_.size() && text.compare(0, printed_.size(), printed_) == 0) {
      std::cout << text.substr(printed_.size()) << std::flush;
      printed_ = text;
    }
  }

 private:
  const ModelChoice& choice_;
  std::vector<std::int32_t> tokens_;
  std::string printed_;
};

}  // namespace

int run_generate(const GenerateOptions& o) {
  const Session session(setup_options(o.timeout_s));
  configure_threads();
  ModelChoice choice;
  std::optional<MixedPrecisionPolicy> mp_policy;
  std::vector<std::string> prompts;
  std::vector<std::vector<int64_t>> prompt_tokens;
  agree_on_inputs([&] {
    mp_policy = parse_param_dtype(o.param_dtype);
    if (o.max_new_tokens < 0) throw InputError("--max-new-tokens must not be negative");
    if (!o.greedy && !(std::isfinite(o.temperature) && o.temperature > 0)) {
      throw InputError("--temperature must be a positive number (or use --greedy), got " +
                       flag_value(o.temperature));
    }
    if (o.top_k < 0) throw InputError("--top-k must not be negative (0: no limit)");
    if (!(o.top_p > 0 && o.top_p <= 1)) {
      throw InputError("--top-p must be in (0, 1], got " + flag_value(o.top_p));
    }
    prompts = read_prompts(o);
    check_tensor_parallel_size(o.tensor_parallel);
    choice = model_for_inference(o.model_dir, o.default_run);
    check_tensor_parallel(o.tensor_parallel, choice.config);
    if (!choice.tokenizer && choice.config.vocab_size < 256) {
      throw InputError("generate needs a byte-level model (vocab_size >= 256); this one has " +
                       std::to_string(choice.config.vocab_size));
    }
    const auto positions = choice.config.max_position_embeddings;
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      prompt_tokens.push_back(encode(choice, prompts[i]));
      const auto length = static_cast<int64_t>(prompt_tokens.back().size());
      if (length == 0) throw InputError("prompt " + std::to_string(i + 1) + " encodes to no token");
      if (length + o.max_new_tokens > positions) {
        throw InputError("prompt " + std::to_string(i + 1) + " (" + std::to_string(length) +
                         " tokens) and --max-new-tokens " + std::to_string(o.max_new_tokens) +
                         " exceed the model's max_position_embeddings " +
                         std::to_string(positions));
      }
    }
  });
  const JobLayout layout = make_layout(o.tensor_parallel);
  const hf::ParallelModel built = build_wrapped_model(choice, o.seed, layout, mp_policy);
  hf::CausalLM model = built.model;
  // A quantized checkpoint samples as its quantized model (inputs fake-quantized).
  const auto quantizers = checkpoint_quantizers(choice, built);
  model->eval();
  say("mdist generate: model " + choice.description);
  if (mp_policy) say("mdist generate: " + describe_mixed_precision(*mp_policy, model));
  say("mdist generate: " + tokenizer_line(choice));

  hf::GenerationOptions options;
  options.max_new_tokens = o.max_new_tokens;
  options.greedy = o.greedy;
  options.temperature = o.temperature;
  options.top_k = o.top_k;
  options.top_p = o.top_p;
  options.seed = o.seed;
  options.eos_token_ids = hf::eos_token_ids(choice.config);
  if (choice.config.pad_token_id) options.pad_token_id = *choice.config.pad_token_id;
  // Split over tensor-parallel ranks, only the last position's logits are gathered.
  options.full_logits = [&](const at::Tensor& logits) {
    return hf::full_logits(built.parallelism, logits);
  };
  // Sampling runs on the CPU with a seeded generator; rank 0's choice is the one every rank
  // continues with, so the output is the same on any number of ranks.
  options.share = [](const std::vector<int64_t>& tokens) { return broadcast(tokens); };

  // One prompt streams its continuation as it comes; a batch is printed when it is done.
  const bool stream = prompts.size() == 1 && rank() == 0;
  Printer streamed(choice);
  int64_t steps = 0;
  if (stream) {
    std::cout << "----\n" << prompts.front() << std::flush;
    options.on_step = [&](const std::vector<int64_t>& tokens, const std::vector<bool>& finished) {
      ++steps;
      if (finished.front()) return;
      const auto& eos = options.eos_token_ids;
      const bool end = std::find(eos.begin(), eos.end(), tokens.front()) != eos.end();
      streamed.add(tokens.front(), end || steps == o.max_new_tokens);
    };
  }
  const auto outputs = hf::generate(model, prompt_tokens, options);
  if (rank() != 0) return 0;
  for (std::size_t i = 0; i < prompts.size() && !stream; ++i) {
    std::cout << (i == 0 ? "----\n" : "\n----\n") << prompts[i];
    Printer printer(choice);
    for (std::size_t t = 0; t < outputs[i].size(); ++t) {
      printer.add(outputs[i][t], t + 1 == outputs[i].size());
    }
  }
  std::cout << "\n----" << std::endl;
  return 0;
}

}  // namespace mdist::cli
