// See src/cli/sft_data.h.
#include "src/cli/sft_data.h"

#include <torch/torch.h>

#include <vector>

#include "mdist/runtime/runtime.h"
#include "src/cli/input_error.h"
#include "src/cli/sft_examples.h"
#include "src/cli/sft_token_file.h"

namespace mdist::cli {
namespace {

// A JSON Lines file's examples, tokenized and held in memory.
class InMemorySftExamples final : public SftExampleSet {
 public:
  explicit InMemorySftExamples(std::vector<SftExample> examples) : examples_(std::move(examples)) {}
  std::int64_t count() const override { return static_cast<std::int64_t>(examples_.size()); }
  std::int64_t length(std::int64_t example) const override {
    return static_cast<std::int64_t>(examples_[static_cast<std::size_t>(example)].ids.size());
  }
  void read(std::int64_t example, std::int64_t* ids, unsigned char* loss) const override {
    const SftExample& e = examples_[static_cast<std::size_t>(example)];
    for (std::size_t i = 0; i < e.ids.size(); ++i) {
      ids[i] = e.ids[i];
      loss[i] = static_cast<std::int64_t>(i) >= e.prompt_tokens ? 1 : 0;
    }
  }

 private:
  std::vector<SftExample> examples_;
};

}  // namespace

SftSequences lay_out_sft(std::shared_ptr<const SftExampleSet> examples, const std::string& name,
                         std::int64_t completion_tokens, std::int64_t seq_len, bool packing,
                         std::int64_t pad_id) {
  SftSequences data;
  // Rows as runs of examples: one each, or filled greedily in file order.
  std::int64_t used = seq_len;
  for (std::int64_t e = 0; e < examples->count(); ++e) {
    const std::int64_t length = examples->length(e);
    if (!packing || used + length > seq_len) {
      data.row_starts.push_back(e);
      used = 0;
    }
    used += length;
  }
  data.row_starts.push_back(examples->count());
  data.seq_len = seq_len;
  data.packed = packing;
  data.pad_id = pad_id;
  data.description = name + " (sft, " + std::to_string(examples->count()) + " examples, " +
                     std::to_string(completion_tokens) + " completion tokens, " +
                     (packing ? "packed into " : "padded: ") + std::to_string(data.rows()) +
                     " rows)";
  data.examples = std::move(examples);
  return data;
}

train::Batch SftSequences::batch(const std::vector<std::int64_t>& which) const {
  const auto B = static_cast<std::int64_t>(which.size());
  const std::int64_t T = seq_len;
  at::Tensor ids = torch::full({B, T}, pad_id, torch::kInt64);
  at::Tensor labels = torch::full({B, T}, -100, torch::kInt64);
  at::Tensor mask = torch::zeros({B, T}, torch::kInt64);
  at::Tensor positions = torch::zeros({B, T}, torch::kInt64);
  auto* id = ids.data_ptr<std::int64_t>();
  auto* label = labels.data_ptr<std::int64_t>();
  auto* real = mask.data_ptr<std::int64_t>();
  auto* position = positions.data_ptr<std::int64_t>();
  std::vector<unsigned char> loss(static_cast<std::size_t>(T));
  for (std::int64_t b = 0; b < B; ++b) {
    const auto row = static_cast<std::size_t>(which[static_cast<std::size_t>(b)]);
    std::int64_t t = b * T;
    for (std::int64_t e = row_starts[row]; e < row_starts[row + 1]; ++e) {
      const std::int64_t length = examples->length(e);
      examples->read(e, id + t, loss.data());
      for (std::int64_t i = 0; i < length; ++i, ++t) {
        // The prompt and, when packed, the example's first token are not predicted.
        label[t] = loss[static_cast<std::size_t>(i)] != 0 && i > 0 ? id[t] : -100;
        real[t] = 1;
        position[t] = i;
      }
    }
    for (std::int64_t i = 0; t < (b + 1) * T; ++i, ++t) position[t] = i;  // the tail
  }
  return train::Batch{.ids = ids,
                      .labels = labels,
                      .attention_mask = packed ? at::Tensor() : mask,
                      .position_ids = packed ? positions : at::Tensor()};
}

SftSequences load_sft(const std::filesystem::path& path, const hf::Tokenizer& tokenizer,
                      const ModelDataOptions& options, std::int64_t seq_len,
                      std::int64_t vocab_size) {
  std::vector<SftExample> examples =
      read_sft_examples(path, tokenizer, options, seq_len, vocab_size);
  std::int64_t completion_tokens = 0;
  for (const SftExample& e : examples) {
    completion_tokens += static_cast<std::int64_t>(e.ids.size()) - e.prompt_tokens;
  }
  return lay_out_sft(std::make_shared<const InMemorySftExamples>(std::move(examples)),
                     path.string(), completion_tokens, seq_len, options.packing,
                     tokenizer.eos_token_id().value_or(0));
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
  const DataFormat format = resolve_data_format(path, parse_data_format(options.data_format));
  const bool tokenized = format == DataFormat::u16 || format == DataFormat::u32;
  if (!tokenized && !model.tokenizer) {
    throw InputError("--format sft needs the model's tokenizer (tokenizer.json in its directory)");
  }
  if (options.seq_len > model.config.max_position_embeddings) {
    throw InputError("--seq-len " + std::to_string(options.seq_len) +
                     " exceeds the model's max_position_embeddings " +
                     std::to_string(model.config.max_position_embeddings));
  }
  check_at_least(options.seq_len, 1, "--seq-len");
  if (tokenized) {
    const std::int64_t pad = model.tokenizer ? model.tokenizer->eos_token_id().value_or(0) : 0;
    // The id range check is split across the ranks (agree_on_inputs combines the outcomes).
    return load_tokenized_sft(path, format, options, options.seq_len, model.config.vocab_size, pad,
                              {rank(), size()});
  }
  return load_sft(path, *model.tokenizer, options, options.seq_len, model.config.vocab_size);
}

train::SequenceSource sft_source(const SftSequences& data, std::shared_ptr<WindowOrder> order) {
  train::SequenceSource source;
  source.count = data.rows();
  source.length = data.seq_len;
  source.description = data.description;
  source.rows = [&data, order](const std::vector<std::int64_t>& which) {
    std::vector<std::int64_t> rows = which;
    if (order) {
      for (auto& row : rows) row = order->window_of(row);
    }
    return data.batch(rows);
  };
  return source;
}

}  // namespace mdist::cli
