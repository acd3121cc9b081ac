#include "src/cli/job_data.h"

#include <torch/torch.h>

#include "mdist/runtime/runtime.h"
#include "src/cli/document_encoder.h"
#include "src/cli/documents.h"
#include "src/cli/input_error.h"

namespace mdist::cli {

namespace {

// Text through the model's tokenizer: each line a document, encoded as `mdist tokenize` does
// (add_special_tokens, then EOS), so that training on the text and on its tokenized .u32 file
// are the same. The ids are held in memory (4 bytes a token, on every rank): for a large corpus,
// run `mdist tokenize` once and train on its memory-mapped output.
TokenStream tokenized_text(const std::filesystem::path& path, const hf::Tokenizer& tokenizer,
                           DataSplit split, std::int64_t vocab_size) {
  const MappedFile file(path, "data file");
  const DocumentEncoder encoder(tokenizer);
  std::vector<std::int32_t> ids;
  for_each_document(file, 0, file.size(), DocumentOptions{},
                    [&](std::string_view doc, std::size_t) { encoder.encode(doc, ids); });
  return token_stream_of(std::move(ids), path.string(), "text, tokenizer", split, vocab_size);
}

}  // namespace

TokenStream load_data(const ModelDataOptions& options, DataSplit default_split,
                      std::int64_t vocab_size, const hf::Tokenizer* tokenizer) {
  const DataFormat format = parse_data_format(options.data_format);
  DataSplit split = DataSplit::all;
  if (options.split == "auto") {
    split = options.data ? DataSplit::all : default_split;
  } else {
    split = parse_data_split(options.split);
  }
  // The id range check is split across the ranks (agree_on_inputs combines the outcomes).
  if (options.data && tokenizer != nullptr &&
      resolve_data_format(*options.data, format) == DataFormat::text) {
    return tokenized_text(*options.data, *tokenizer, split, vocab_size);
  }
  if (options.data) {
    return load_tokens(*options.data, format, split, vocab_size, {rank(), size()});
  }
  return load_tokens_from_bytes(embedded_corpus(), std::string(kEmbeddedCorpusName) + " [embedded]",
                                DataFormat::text, split, vocab_size);
}

at::Tensor batch_of(const Windows& windows, const std::vector<std::int64_t>& which) {
  const int64_t T = windows.seq_len();
  auto ids = torch::empty({static_cast<int64_t>(which.size()), T}, torch::kInt64);
  auto* out = ids.data_ptr<int64_t>();
  for (std::size_t b = 0; b < which.size(); ++b) {
    windows.copy(which[b], out + static_cast<int64_t>(b) * T);
  }
  return ids;
}

train::SequenceSource sequence_source(const Windows& windows, std::string description,
                                      std::shared_ptr<WindowOrder> order) {
  train::SequenceSource source;
  source.count = windows.count();
  source.length = windows.seq_len();
  source.description = std::move(description);
  source.rows = [&windows, order](const std::vector<std::int64_t>& which) {
    if (!order) return train::Batch{.ids = batch_of(windows, which)};
    std::vector<std::int64_t> ordered;
    ordered.reserve(which.size());
    for (const std::int64_t position : which) ordered.push_back(order->window_of(position));
    return train::Batch{.ids = batch_of(windows, ordered)};
  };
  return source;
}

TokenStream load_checked_data(const ModelDataOptions& options, DataSplit default_split,
                              const ModelChoice& model, const char* command) {
  TokenStream data =
      load_data(options, default_split, model.config.vocab_size, model.tokenizer.get());
  const Windows windows(data, options.seq_len, command);
  if (options.seq_len > model.config.max_position_embeddings) {
    throw InputError("--seq-len " + std::to_string(options.seq_len) +
                     " exceeds the model's max_position_embeddings " +
                     std::to_string(model.config.max_position_embeddings));
  }
  return data;
}

}  // namespace mdist::cli
