#include "src/cli/document_encoder.h"

#include <algorithm>

#include "src/cli/input_error.h"

namespace mdist::cli {

DocumentEncoder::DocumentEncoder(const hf::Tokenizer& tokenizer)
    : tokenizer_(&tokenizer), eos_(tokenizer.eos_token_id()) {
  const std::string_view probe = "mdist probe";
  const auto plain = tokenizer.encode(probe, false);
  const auto full = tokenizer.encode(probe, true);
  const auto at = std::search(full.begin(), full.end(), plain.begin(), plain.end());
  if (!plain.empty() && at != full.end()) {
    prefix_.assign(full.begin(), at);
    suffix_.assign(at + static_cast<std::ptrdiff_t>(plain.size()), full.end());
    template_known_ = true;
  }
}

void DocumentEncoder::encode(std::string_view document, std::vector<std::int32_t>& out) const {
  const auto ids = tokenizer_->encode(document, true);
  out.insert(out.end(), ids.begin(), ids.end());
  if (eos_) out.push_back(*eos_);
}

void DocumentEncoder::encode_long(
    std::string_view document,
    const std::function<void(std::span<const std::int32_t>)>& sink) const {
  if (!template_known_) {
    throw InputError(
        "--sample-by document: cannot tell where this tokenizer's post-processor puts its "
        "special tokens; use --sample-by line or paragraph");
  }
  constexpr std::size_t kPiece = std::size_t{1} << 20;
  sink(prefix_);
  hf::Tokenizer::StreamEncoder stream(*tokenizer_);
  std::vector<std::int32_t> ids;
  for (std::size_t at = 0; at < document.size();) {
    std::size_t n = std::min(kPiece, document.size() - at);
    // Pieces end after a newline where there is one (a cut no pre-tokenizer merges across).
    if (at + n < document.size()) {
      const auto nl = document.substr(at, n).rfind('\n');
      if (nl != std::string_view::npos) n = nl + 1;
    }
    stream.feed(document.substr(at, n), ids);
    sink(ids);
    ids.clear();
    at += n;
  }
  stream.finish(ids);
  ids.insert(ids.end(), suffix_.begin(), suffix_.end());
  if (eos_) ids.push_back(*eos_);
  sink(ids);
}

}  // namespace mdist::cli
