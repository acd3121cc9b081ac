// Single-threaded encode throughput of mdist::hf::Tokenizer on one corpus, per line and as one
// whole text (bench/tokenizer_encode.sh runs it beside tokenizer_encode.py).
//   tokenizer_encode TOKENIZER_DIR CORPUS MODE(lines|whole) [SECONDS=1.0]
// Prints one JSON line: MB/s, tokens/s, iterations.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "bench/json_line.h"
#include "mdist/hf/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s TOKENIZER_DIR CORPUS lines|whole [SECONDS]\n", argv[0]);
    return 2;
  }
  const auto tokenizer = mdist::hf::Tokenizer::from_directory(argv[1]);
  std::ifstream in(argv[2], std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const std::string mode = argv[3];
  const double seconds = argc > 4 ? std::stod(argv[4]) : 1.0;
  std::vector<std::string_view> lines;
  if (mode == "lines") {
    std::size_t start = 0;
    while (start < text.size()) {
      const auto nl = text.find('\n', start);
      const auto end = nl == std::string::npos ? text.size() : nl;
      lines.push_back(std::string_view(text).substr(start, end - start));
      start = end + 1;
    }
  } else if (mode != "whole") {
    std::fprintf(stderr, "mode must be lines or whole, not '%s'\n", mode.c_str());
    return 2;
  }
  auto run_once = [&] {
    std::size_t tokens = 0;
    if (mode == "whole") {
      tokens = tokenizer.encode(text, false).size();
    } else {
      for (const auto line : lines) tokens += tokenizer.encode(line, false).size();
    }
    return tokens;
  };
  run_once();  // warm-up: word cache, page cache
  using Clock = std::chrono::steady_clock;
  const auto begin = Clock::now();
  std::size_t tokens = 0;
  int iterations = 0;
  double elapsed = 0;
  do {
    tokens += run_once();
    ++iterations;
    elapsed = std::chrono::duration<double>(Clock::now() - begin).count();
  } while (elapsed < seconds);
  mdist::bench::JsonLine()
      .add("impl", "mdist (C++)")
      .add("mode", mode.c_str())
      .add("mb_per_s", static_cast<double>(text.size()) * iterations / elapsed / 1e6)
      .add("tokens_per_s", static_cast<double>(tokens) / elapsed)
      .add("iterations", iterations)
      .print();
}
