// mdist::hf::generate: batched, left-padded generation with a KV cache.
#include "mdist/hf/generate.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "mdist/error.h"
#include "mdist/hf/kv_cache.h"

namespace mdist::hf {
namespace {

void check_options(const GenerationOptions& o) {
  if (o.max_new_tokens < 0) throw Error("mdist::hf::generate: max_new_tokens must not be negative");
  if (o.greedy) return;
  if (!(std::isfinite(o.temperature) && o.temperature > 0)) {
    throw Error("mdist::hf::generate: temperature must be a positive number, got " +
                std::to_string(o.temperature));
  }
  if (o.top_k < 0) throw Error("mdist::hf::generate: top_k must not be negative (0: no limit)");
  if (!(o.top_p > 0 && o.top_p <= 1)) {
    throw Error("mdist::hf::generate: top_p must be in (0, 1], got " + std::to_string(o.top_p));
  }
}

}  // namespace

at::Tensor choose_tokens(const at::Tensor& logits, const GenerationOptions& o,
                         at::Generator& generator) {
  if (o.greedy) return logits.argmax(-1);
  constexpr float kMinusInfinity = -std::numeric_limits<float>::infinity();
  at::Tensor scores = logits / o.temperature;
  if (o.top_k > 0 && o.top_k < scores.size(-1)) {
    // Everything below the k-th largest score goes; scores equal to it stay.
    const at::Tensor kth = std::get<0>(scores.topk(o.top_k, -1)).narrow(-1, o.top_k - 1, 1);
    scores = scores.masked_fill(scores < kth, kMinusInfinity);
  }
  if (o.top_p < 1) {
    // Ascending order: a token goes while the probability of it and everything less likely
    // stays within 1 - top_p; the likeliest token always stays.
    const auto [sorted, order] = scores.sort(/*dim=*/-1, /*descending=*/false);
    const at::Tensor cumulative = sorted.softmax(-1).cumsum(-1);
    at::Tensor drop = cumulative <= (1 - o.top_p);
    drop.narrow(-1, drop.size(-1) - 1, 1).fill_(false);
    scores = scores.masked_fill(drop.scatter(-1, order, drop), kMinusInfinity);
  }
  return torch::multinomial(scores.softmax(-1), 1, false, generator).squeeze(-1);
}

std::vector<int64_t> eos_token_ids(const LlamaConfig& config) {
  if (config.source_json.empty()) return {};
  const auto j = nlohmann::json::parse(config.source_json, nullptr, /*allow_exceptions=*/false);
  const auto it = j.is_object() ? j.find("eos_token_id") : j.end();
  if (it == j.end() || it->is_null()) return {};
  std::vector<int64_t> ids;
  if (it->is_number_integer()) ids.push_back(it->get<int64_t>());
  if (it->is_array()) {
    for (const auto& id : *it) {
      if (id.is_number_integer()) ids.push_back(id.get<int64_t>());
    }
  }
  return ids;
}

std::vector<std::vector<int64_t>> generate(CausalLM& model,
                                           const std::vector<std::vector<int64_t>>& prompts,
                                           const GenerationOptions& o) {
  check_options(o);
  if (prompts.empty()) throw Error("mdist::hf::generate: no prompts");
  std::size_t longest = 0;
  for (const auto& prompt : prompts) {
    if (prompt.empty()) throw Error("mdist::hf::generate: an empty prompt");
    longest = std::max(longest, prompt.size());
  }
  const auto batch = static_cast<int64_t>(prompts.size());
  const auto width = static_cast<int64_t>(longest);
  if (width + o.max_new_tokens > model->config.max_position_embeddings) {
    throw Error("mdist::hf::generate: a prompt of " + std::to_string(width) + " tokens and " +
                std::to_string(o.max_new_tokens) + " new tokens exceed the model's " +
                "max_position_embeddings " + std::to_string(model->config.max_position_embeddings));
  }
  const torch::NoGradGuard no_grad;
  const c10::Device device = model->output_weight().device();
  const auto long_cpu = torch::TensorOptions().dtype(at::kLong);

  // Left padding: every row's last prompt token in the last column.
  at::Tensor ids = torch::full({batch, width}, o.pad_token_id, long_cpu);
  at::Tensor mask = torch::ones({batch, width}, long_cpu);
  bool padded = false;
  for (int64_t row = 0; row < batch; ++row) {
    const auto& prompt = prompts[static_cast<std::size_t>(row)];
    const auto pad = width - static_cast<int64_t>(prompt.size());
    padded = padded || pad > 0;
    mask[row].narrow(0, 0, pad).zero_();
    ids[row]
        .narrow(0, pad, static_cast<int64_t>(prompt.size()))
        .copy_(torch::tensor(prompt, long_cpu));
  }
  mask = mask.to(device);
  // Without padding, no mask and the default positions (past .. past + T - 1): the causal path
  // of attention, and what transformers computes for an all-ones mask.
  const auto step_mask = [&] { return padded ? mask : at::Tensor(); };
  const auto step_positions = [&](int64_t tokens) {
    return padded ? generation_position_ids(mask, tokens) : at::Tensor();
  };

  // Phi-3 with longrope, as transformers' Phi3ForCausalLM.prepare_inputs_for_generation: when
  // the sequence first outgrows original_max_position_embeddings, the keys cached so far were
  // rotated with the short factors; the cache is dropped and the whole sequence recomputed on
  // the long ones.
  const auto& rope = model->config.rope_scaling;
  const bool recompute =
      model->config.architecture == "Phi3ForCausalLM" && rope && rope->rope_type == "longrope";
  const int64_t original = rope ? rope->original_max_position_embeddings : 0;
  at::Tensor sequence = ids;  // [batch, tokens so far], for the recomputation

  KvCache cache(model->config.num_hidden_layers);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  std::vector<std::vector<int64_t>> outputs(prompts.size());
  std::vector<bool> finished(prompts.size(), false);
  at::Tensor logits =
      model->forward(ids.to(device), step_mask(), step_positions(width), &cache).select(1, -1);
  for (int64_t step = 0; step < o.max_new_tokens; ++step) {
    const at::Tensor last = o.full_logits ? o.full_logits(logits) : logits;
    const at::Tensor chosen =
        choose_tokens(last.to(at::kCPU, at::kFloat), o, generator).contiguous();
    std::vector<int64_t> next(chosen.data_ptr<int64_t>(),
                              chosen.data_ptr<int64_t>() + chosen.numel());
    if (o.share) next = o.share(next);
    const std::vector<bool> was_finished = finished;
    for (std::size_t row = 0; row < next.size(); ++row) {
      if (finished[row]) {
        next[row] = o.pad_token_id;
        continue;
      }
      outputs[row].push_back(next[row]);
      finished[row] = std::find(o.eos_token_ids.begin(), o.eos_token_ids.end(), next[row]) !=
                      o.eos_token_ids.end();
    }
    if (o.on_step) o.on_step(next, was_finished);
    if (step + 1 == o.max_new_tokens ||
        std::all_of(finished.begin(), finished.end(), [](bool done) { return done; })) {
      break;
    }
    if (padded) mask = at::cat({mask, torch::ones({batch, 1}, mask.options())}, 1);
    const at::Tensor next_ids = torch::tensor(next, long_cpu).view({batch, 1});
    sequence = at::cat({sequence, next_ids}, 1);
    if (recompute && sequence.size(1) > original && cache.length() <= original) {
      cache = KvCache(model->config.num_hidden_layers);
      logits =
          model->forward(sequence.to(device), step_mask(), step_positions(sequence.size(1)), &cache)
              .select(1, -1);
      continue;
    }
    logits =
        model->forward(next_ids.to(device), step_mask(), step_positions(1), &cache).select(1, -1);
  }
  return outputs;
}

}  // namespace mdist::hf
