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
// The rows are built when a batch asks for them, from the examples: held in memory for a JSON
// Lines file (every rank alike), or read from the memory mapping of `mdist tokenize --format sft`
// output (src/cli/sft_token_file.h). Both go through the same layout code, so that the two give
// the same batches bit for bit.
#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "mdist/hf/tokenizer.h"
#include "mdist/train/sequences.h"
#include "src/cli/flags.h"
#include "src/cli/model_choice.h"
#include "src/cli/token_data.h"

namespace mdist::cli {

// Examples as the layout reads them: each a run of ids and, per id, whether the loss is taken
// on it (a completion token).
class SftExampleSet {
 public:
  virtual ~SftExampleSet() = default;
  virtual std::int64_t count() const = 0;
  virtual std::int64_t length(std::int64_t example) const = 0;
  // Example `example`'s ids into ids[0, length) and its loss flags into loss[0, length).
  virtual void read(std::int64_t example, std::int64_t* ids, unsigned char* loss) const = 0;
};

struct SftSequences {
  std::shared_ptr<const SftExampleSet> examples;
  // Row r holds the examples [row_starts[r], row_starts[r + 1]).
  std::vector<std::int64_t> row_starts;
  std::int64_t seq_len = 0;
  bool packed = false;
  std::int64_t pad_id = 0;  // the ids of padding (masked out of attention and loss)
  std::string description;  // "FILE (sft, 12 examples, 80 completion tokens, packed into 3 rows)"
  std::int64_t rows() const { return static_cast<std::int64_t>(row_starts.size()) - 1; }
  // The rows `which` as a batch: ids and labels, with the attention mask (padded) or the
  // position ids (packed).
  train::Batch batch(const std::vector<std::int64_t>& which) const;
};

// `examples` laid out in rows of seq_len (padded or, with packing, packed); `name` and
// `completion_tokens` for the description. Every example must fit in seq_len.
SftSequences lay_out_sft(std::shared_ptr<const SftExampleSet> examples, const std::string& name,
                         std::int64_t completion_tokens, std::int64_t seq_len, bool packing,
                         std::int64_t pad_id);

// Reads and tokenizes `path`. InputError (naming the file and its line) for a line that is
// not a JSON object, lacks a string field, has an empty completion, or whose example has more
// than seq_len tokens; for a file without examples; for an id outside [0, vocab_size).
SftSequences load_sft(const std::filesystem::path& path, const hf::Tokenizer& tokenizer,
                      const ModelDataOptions& options, std::int64_t seq_len,
                      std::int64_t vocab_size);
// load_sft of `path` with `model`'s tokenizer (InputError when it has none) and vocabulary,
// options.seq_len within the model's max_position_embeddings; or, when `path` is a token file
// (.u16 / .u32, or --data-format u16 / u32), the output of `mdist tokenize --format sft` read
// through its memory mapping (load_tokenized_sft), the tokenizer then optional (its EOS pads).
SftSequences load_checked_sft(const std::filesystem::path& path, const ModelDataOptions& options,
                              const ModelChoice& model);

// `data` (which must outlive the result) as the training library's SequenceSource: index i is
// row i, or with `order` the row at position i of the seeded epoch order.
train::SequenceSource sft_source(const SftSequences& data,
                                 std::shared_ptr<WindowOrder> order = nullptr);

}  // namespace mdist::cli
