// See src/cli/sft_token_file.h.
#include "src/cli/sft_token_file.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "src/cli/documents.h"
#include "src/cli/input_error.h"

namespace mdist::cli {
namespace {

// Mask bytes checked (and pages released) per step of the scan.
constexpr std::int64_t kScanChunk = std::int64_t{1} << 20;

// The examples of a tokenized SFT file, read from its two mappings.
class MappedSftExamples final : public SftExampleSet {
 public:
  MappedSftExamples(TokenStream ids, std::shared_ptr<const io::MappedFile> mask,
                    std::vector<std::int64_t> starts)
      : ids_(std::move(ids)), mask_(std::move(mask)), starts_(std::move(starts)) {}
  std::int64_t count() const override { return static_cast<std::int64_t>(starts_.size()) - 1; }
  std::int64_t length(std::int64_t example) const override {
    const auto e = static_cast<std::size_t>(example);
    return starts_[e + 1] - starts_[e];
  }
  void read(std::int64_t example, std::int64_t* ids, unsigned char* loss) const override {
    const std::int64_t first = starts_[static_cast<std::size_t>(example)];
    const std::int64_t n = length(example);
    ids_.copy(first, n, ids);  // releases the ids' pages
    const unsigned char* bytes = mask_->data() + first;
    for (std::int64_t i = 0; i < n; ++i) loss[i] = bytes[i] & kSftLoss;
    mask_->release(static_cast<std::size_t>(first), static_cast<std::size_t>(n));
  }

 private:
  TokenStream ids_;
  std::shared_ptr<const io::MappedFile> mask_;
  std::vector<std::int64_t> starts_;  // example e is tokens [starts_[e], starts_[e + 1])
};

}  // namespace

std::filesystem::path sft_mask_path(const std::filesystem::path& ids_path) {
  return ids_path.string() + ".mask";
}

SftSequences load_tokenized_sft(const std::filesystem::path& path, DataFormat format,
                                const ModelDataOptions& options, std::int64_t seq_len,
                                std::int64_t vocab_size, std::int64_t pad_id, CheckPart part) {
  const std::filesystem::path mask_path = sft_mask_path(path);
  TokenStream ids = load_tokens(path, format, DataSplit::all, vocab_size, part);
  auto mask = std::make_shared<const MappedFile>(mask_path, "loss-mask file");
  const std::string name = "data file '" + path.string() + "'";
  const std::string mask_name = "loss-mask file '" + mask_path.string() + "'";
  const std::int64_t total = ids.size();
  if (static_cast<std::int64_t>(mask->size()) != total) {
    throw InputError(mask_name + " has " + std::to_string(mask->size()) + " bytes but " + name +
                     " has " + std::to_string(total) +
                     " tokens (one mask byte a token): a truncated or mismatched pair; run mdist "
                     "tokenize --format sft again");
  }
  if (total == 0) throw InputError(name + " holds no example");
  std::vector<std::int64_t> starts;
  std::int64_t completion_tokens = 0;
  std::int64_t example_loss = 0;  // completion tokens of the example being scanned
  const auto close_example = [&](std::int64_t end) {
    const std::int64_t first = starts.back();
    const auto number = static_cast<std::int64_t>(starts.size());
    if (example_loss == 0) {
      throw InputError(mask_name + ": example " + std::to_string(number) + " (tokens " +
                       std::to_string(first) + " to " + std::to_string(end - 1) +
                       ") has no completion token");
    }
    if (end - first > seq_len) {
      throw InputError(name + ": example " + std::to_string(number) + " (tokens " +
                       std::to_string(first) + " to " + std::to_string(end - 1) + ") has " +
                       std::to_string(end - first) + " tokens, more than --seq-len " +
                       std::to_string(seq_len));
    }
  };
  const unsigned char* bytes = mask->data();
  for (std::int64_t begin = 0; begin < total; begin += kScanChunk) {
    const std::int64_t end = std::min(total, begin + kScanChunk);
    for (std::int64_t i = begin; i < end; ++i) {
      const unsigned char byte = bytes[i];
      if (byte > (kSftLoss | kSftExampleStart)) {
        throw InputError(mask_name + ": byte " + std::to_string(i) + " is " + std::to_string(byte) +
                         ", not a loss-mask byte (0 to 3)");
      }
      if ((byte & kSftExampleStart) != 0) {
        if (!starts.empty()) close_example(i);
        starts.push_back(i);
        example_loss = 0;
      } else if (starts.empty()) {
        throw InputError(mask_name + " does not start an example at its first byte");
      }
      example_loss += byte & kSftLoss;
      completion_tokens += byte & kSftLoss;
    }
    mask->release(static_cast<std::size_t>(begin), static_cast<std::size_t>(end - begin));
  }
  close_example(total);
  starts.push_back(total);
  return lay_out_sft(
      std::make_shared<const MappedSftExamples>(std::move(ids), std::move(mask), std::move(starts)),
      path.string(), completion_tokens, seq_len, options.packing, pad_id);
}

}  // namespace mdist::cli
