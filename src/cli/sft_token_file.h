#pragma once
// Supervised fine-tuning examples as `mdist tokenize --format sft` writes them, and their
// memory-mapped reader for `mdist train|eval --data OUT --format sft`. Two files:
//   OUT (.u16 / .u32): the examples' ids, concatenated in the order of the JSON Lines file,
//     little-endian, as the tokenizer and the SFT rule give them (src/cli/sft_data.h);
//   OUT.mask: one byte a token, the same count: bit 0 (1) the loss is taken on that token (a
//     completion token, EOS included), bit 1 (2) the token starts an example; the other bits 0.
// So a prompt's first token is 2 (3 when the prompt is empty and adds no token), its others 0,
// the completion's 1: the example boundaries live in the mask, and the two files together give
// the JSON Lines file's rows bit for bit.
//
// The reader never holds the files: it scans them once in chunks (pages handed back as it goes)
// to check them and to find where each example starts (8 bytes an example in memory), then
// reads a batch's examples from the mappings when the batch is built.
#include <cstdint>
#include <filesystem>

#include "src/cli/flags.h"
#include "src/cli/sft_data.h"
#include "src/cli/token_data.h"

namespace mdist::cli {

// The mask file next to a tokenized SFT file: `ids_path` + ".mask".
std::filesystem::path sft_mask_path(const std::filesystem::path& ids_path);

// Mask bits.
inline constexpr unsigned char kSftLoss = 1;
inline constexpr unsigned char kSftExampleStart = 2;

// The examples of the tokenized SFT file `path` (`format`: u16 or u32) and its mask, laid out in
// rows as load_sft lays out a JSON Lines file's (options.packing; `pad_id` pads). InputError
// naming the file for: a missing or unreadable file, an ids file whose size is not a multiple
// of its width, a mask whose length differs from the ids' (a truncated or mismatched pair), a
// mask byte other than 0-3, a mask not starting an example at its first byte, an example
// without a completion token or longer than seq_len, no example, an id outside
// [0, vocab_size) (`part`: this process's share of that check, as load_tokens).
SftSequences load_tokenized_sft(const std::filesystem::path& path, DataFormat format,
                                const ModelDataOptions& options, std::int64_t seq_len,
                                std::int64_t vocab_size, std::int64_t pad_id, CheckPart part = {});

}  // namespace mdist::cli
