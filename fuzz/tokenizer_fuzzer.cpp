// libFuzzer target for mdist::hf::Tokenizer: arbitrary bytes (invalid UTF-8 included) through
// encode, decode and the StreamEncoder of every fixture family of tests/hf/tokenizer. Besides
// the sanitizers, it checks that the stream's ids equal one encode() of the whole text.
//   build-fuzz/bin/tokenizer_fuzzer [libFuzzer flags]
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "mdist/hf/tokenizer.h"

namespace {

const std::vector<mdist::hf::Tokenizer>& tokenizers() {
  static const auto all = [] {
    std::vector<mdist::hf::Tokenizer> out;
    for (const char* family :
         {"gpt2", "llama3", "qwen2", "bytelevel_prefix_nfkc", "llama2", "mistral",
          "metaspace_split", "subword_split_variants", "invert_nfkd_unk"}) {
      out.push_back(mdist::hf::Tokenizer::from_directory(std::string(MDIST_TOKENIZER_FIXTURES) +
                                                         "/" + family));
    }
    return out;
  }();
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const auto& all = tokenizers();
  const auto& tokenizer = all[data[0] % all.size()];
  const std::size_t piece = 1 + data[1] % 16;  // stream piece size
  const std::string_view text(reinterpret_cast<const char*>(data) + 2, size - 2);

  const auto ids = tokenizer.encode(text, false);
  const auto with_special = tokenizer.encode(text, true);
  (void)tokenizer.decode(with_special, false);
  (void)tokenizer.decode(with_special, true);

  mdist::hf::Tokenizer::StreamEncoder stream(tokenizer);
  std::vector<std::int32_t> streamed;
  for (std::size_t pos = 0; pos < text.size(); pos += piece) {
    stream.feed(text.substr(pos, piece), streamed);
  }
  stream.finish(streamed);
  if (streamed != ids) std::abort();  // the stream must equal the whole encode
  return 0;
}
