// See src/cli/sft_data.h.
#include "src/cli/sft_data.h"

#include <torch/torch.h>

#include <vector>

#include "src/cli/input_error.h"
#include "src/cli/sft_examples.h"

namespace mdist::cli {

SftSequences load_sft(const std::filesystem::path& path, const hf::Tokenizer& tokenizer,
                      const ModelDataOptions& options, std::int64_t seq_len,
                      std::int64_t vocab_size) {
  const std::vector<SftExample> examples =
      read_sft_examples(path, tokenizer, options, seq_len, vocab_size);
  // Rows as lists of examples: one each, or filled greedily in file order.
  std::vector<std::vector<std::size_t>> rows;
  std::int64_t used = seq_len;
  for (std::size_t e = 0; e < examples.size(); ++e) {
    const auto length = static_cast<std::int64_t>(examples[e].ids.size());
    if (!options.packing || used + length > seq_len) {
      rows.emplace_back();
      used = 0;
    }
    rows.back().push_back(e);
    used += length;
  }
  const auto R = static_cast<std::int64_t>(rows.size());
  const std::int32_t pad = tokenizer.eos_token_id().value_or(0);
  at::Tensor ids = torch::full({R, seq_len}, pad, torch::kInt64);
  at::Tensor labels = torch::full({R, seq_len}, -100, torch::kInt64);
  at::Tensor mask = torch::zeros({R, seq_len}, torch::kInt64);
  at::Tensor positions = torch::zeros({R, seq_len}, torch::kInt64);
  auto* id = ids.data_ptr<std::int64_t>();
  auto* label = labels.data_ptr<std::int64_t>();
  auto* real = mask.data_ptr<std::int64_t>();
  auto* position = positions.data_ptr<std::int64_t>();
  std::int64_t completion_tokens = 0;
  for (std::int64_t r = 0; r < R; ++r) {
    std::int64_t t = r * seq_len;
    for (const std::size_t e : rows[static_cast<std::size_t>(r)]) {
      const SftExample& example = examples[e];
      for (std::size_t i = 0; i < example.ids.size(); ++i, ++t) {
        const auto index = static_cast<std::int64_t>(i);
        id[t] = example.ids[i];
        // The prompt and, when packed, the example's first token are not predicted.
        label[t] = index >= example.prompt_tokens && index > 0 ? example.ids[i] : -100;
        real[t] = 1;
        position[t] = index;
      }
      completion_tokens += static_cast<std::int64_t>(example.ids.size()) - example.prompt_tokens;
    }
    for (std::int64_t i = 0; t < (r + 1) * seq_len; ++i, ++t) position[t] = i;  // the tail
  }
  SftSequences data;
  data.ids = ids;
  data.labels = labels;
  if (options.packing) {
    data.position_ids = positions;
  } else {
    data.attention_mask = mask;
  }
  data.examples = static_cast<std::int64_t>(examples.size());
  data.description = path.string() + " (sft, " + std::to_string(data.examples) + " examples, " +
                     std::to_string(completion_tokens) + " completion tokens, " +
                     (options.packing ? "packed into " : "padded: ") + std::to_string(R) + " rows)";
  return data;
}

SftSequences load_checked_sft(const std::filesystem::path& path, const ModelDataOptions& options,
                              const ModelChoice& model) {
  if (options.packing && model.config.moe) {
    // transformers' packed rows carry no attention mask, so a mixture of experts'
    // load-balancing loss would count the padding at their ends; not supported yet.
    throw InputError(
        "--packing is not supported for a mixture of experts (its load-balancing loss would "
        "count the padding of packed rows); train it without --packing");
  }
  if (!model.tokenizer) {
    throw InputError("--format sft needs the model's tokenizer (tokenizer.json in its directory)");
  }
  if (options.seq_len > model.config.max_position_embeddings) {
    throw InputError("--seq-len " + std::to_string(options.seq_len) +
                     " exceeds the model's max_position_embeddings " +
                     std::to_string(model.config.max_position_embeddings));
  }
  check_at_least(options.seq_len, 1, "--seq-len");
  return load_sft(path, *model.tokenizer, options, options.seq_len, model.config.vocab_size);
}

train::SequenceSource sft_source(const SftSequences& data, std::shared_ptr<WindowOrder> order) {
  train::SequenceSource source;
  source.count = data.rows();
  source.length = data.ids.size(1);
  source.description = data.description;
  source.rows = [&data, order](const std::vector<std::int64_t>& which) {
    std::vector<std::int64_t> rows = which;
    if (order) {
      for (auto& row : rows) row = order->window_of(row);
    }
    const at::Tensor index = torch::tensor(rows, torch::kInt64);
    const auto pick = [&](const at::Tensor& t) {
      return t.defined() ? t.index_select(0, index) : t;
    };
    return train::Batch{.ids = pick(data.ids),
                        .labels = pick(data.labels),
                        .attention_mask = pick(data.attention_mask),
                        .position_ids = pick(data.position_ids)};
  };
  return source;
}

}  // namespace mdist::cli
