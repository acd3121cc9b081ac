#pragma once
// Supervised fine-tuning data (--format sft): a JSON Lines file of prompt / completion pairs,
// tokenized with the model's tokenizer as TRL's SFTTrainer tokenizes prompt-completion data
// with completion-only loss, and laid out as the training library's sequences.
//
// Tokenization of one example (the rule tests/hf_model/make_sft_fixtures.py checks against the
// Python tokenizers library, written there as TRL writes it):
//   prompt_ids = encode(prompt, add_special_tokens = true)
//   ids        = encode(prompt + completion, add_special_tokens = true) + [EOS]
// (TRL appends the EOS token's text to the completion; the tokenizer reads it as that one
// special token, so the ids are the same), and the loss is taken on ids[len(prompt_ids):]
// only: prompt positions get the label -100. A tokenizer without an EOS appends nothing.
//
// Layout, with T = --seq-len:
//   padded (default): one example per row, right-padded to T; padding has label -100 and
//     attention mask 0, so it is neither predicted nor attended to.
//   packed (--packing): examples in file order fill rows greedily (an example that does not
//     fit in the rest of a row starts the next); each example's position ids restart at 0 and
//     the model masks attention per example (hf::DecoderModelImpl::forward, as transformers'
//     packed training). The first token of each example has label -100 (it is not predicted
//     from the example before it), so a packed batch has exactly the predicted tokens of the
//     padded one. A row's unused tail is padding: its own positions from 0, label -100.
// The examples are held in memory (tensors [rows, T] of int64), every rank alike.
#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "mdist/hf/tokenizer.h"
#include "mdist/train/sequences.h"
#include "src/cli/flags.h"
#include "src/cli/model_choice.h"
#include "src/cli/token_data.h"

namespace mdist::cli {

struct SftSequences {
  at::Tensor ids;             // [rows, T] int64
  at::Tensor labels;          // [rows, T] int64, -100 where no loss is taken
  at::Tensor attention_mask;  // padded: [rows, T] 0/1; packed: undefined
  at::Tensor position_ids;    // packed: [rows, T] int64; padded: undefined
  std::int64_t examples = 0;
  std::string description;  // "FILE (sft, 12 examples, 80 completion tokens, packed: 3 rows)"
  std::int64_t rows() const { return ids.size(0); }
};

// Reads and tokenizes `path`. InputError (naming the file and its line) for a line that is
// not a JSON object, lacks a string field, has an empty completion, or whose example has more
// than seq_len tokens; for a file without examples; for an id outside [0, vocab_size).
SftSequences load_sft(const std::filesystem::path& path, const hf::Tokenizer& tokenizer,
                      const ModelDataOptions& options, std::int64_t seq_len,
                      std::int64_t vocab_size);
// load_sft of `path` with `model`'s tokenizer (InputError when it has none) and vocabulary,
// options.seq_len within the model's max_position_embeddings.
SftSequences load_checked_sft(const std::filesystem::path& path, const ModelDataOptions& options,
                              const ModelChoice& model);

// `data` (which must outlive the result) as the training library's SequenceSource: index i is
// row i, or with `order` the row at position i of the seeded epoch order.
train::SequenceSource sft_source(const SftSequences& data,
                                 std::shared_ptr<WindowOrder> order = nullptr);

}  // namespace mdist::cli
