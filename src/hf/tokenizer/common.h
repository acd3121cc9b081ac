#pragma once
// Shared pieces of the tokenizer.json implementation: the JSON type, the error helper that
// names the file, and the buffer of pre-tokenized pieces the pipeline passes between stages.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "mdist/hf/tokenizer.h"

namespace mdist::hf::tok {

using Json = nlohmann::json;

// Every load error goes through here so that the message names the file.
[[noreturn]] inline void fail(const std::string& file, const std::string& what) {
  throw TokenizerError("mdist::hf::Tokenizer: " + file + ": " + what);
}

// The "type" of a component object, or a TokenizerError naming `component`.
std::string type_of(const Json& j, const std::string& file, const char* component);

// Pieces of text owned by one buffer: a stage reads one Pieces and writes the next, so the
// pipeline allocates per call, not per piece.
struct Pieces {
  struct Span {
    std::uint32_t begin;
    std::uint32_t end;
    // The piece starts a segment of its own (not the continuation of a streamed text), so
    // prefix-adding steps (Prepend, add_prefix_space, Metaspace "always") apply to it.
    bool segment_start;
    // The piece starts at offset 0 of the original text (Metaspace prepend_scheme "first").
    bool text_start;
  };
  std::string buf;
  std::vector<Span> spans;

  std::string_view view(const Span& s) const { return {buf.data() + s.begin, s.end - s.begin}; }
  void clear() {
    buf.clear();
    spans.clear();
  }
  void add(std::string_view text, bool segment_start, bool text_start) {
    const auto begin = static_cast<std::uint32_t>(buf.size());
    buf.append(text);
    spans.push_back({begin, static_cast<std::uint32_t>(buf.size()), segment_start, text_start});
  }
};

}  // namespace mdist::hf::tok
