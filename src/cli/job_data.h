#pragma once
// A command's token data: the embedded corpus or a file (text through the model's tokenizer, or
// token ids), checked against the model, and its windows as tensors and as the training
// library's SequenceSource.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mdist/hf/tokenizer.h"
#include "mdist/train/sequences.h"
#include "src/cli/flags.h"
#include "src/cli/model_choice.h"
#include "src/cli/token_data.h"

namespace mdist::cli {

// The token stream of a command (embedded corpus or a file), checked against the vocabulary.
// `default_split` applies to the embedded corpus when options.split is "auto".
// Text data (not the embedded corpus) goes through `tokenizer` when one is given.
TokenStream load_data(const ModelDataOptions& options, DataSplit default_split,
                      std::int64_t vocab_size, const hf::Tokenizer* tokenizer = nullptr);

// The windows `which` as an int64 tensor [which.size(), seq_len].
at::Tensor batch_of(const Windows& windows, const std::vector<std::int64_t>& which);
// `windows` (which must outlive the result) as the training library's SequenceSource: index i
// is window i, or with `order` the window at position i of the seeded epoch order.
train::SequenceSource sequence_source(const Windows& windows, std::string description,
                                      std::shared_ptr<WindowOrder> order = nullptr);

// load_data for `model`, plus the checks every command needs: at least one sequence of
// options.seq_len tokens, and seq_len within the model's max_position_embeddings.
TokenStream load_checked_data(const ModelDataOptions& options, DataSplit default_split,
                              const ModelChoice& model, const char* command);

}  // namespace mdist::cli
