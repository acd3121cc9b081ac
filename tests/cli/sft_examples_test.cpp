// The examples of an SFT file (src/cli/sft_examples.h) tokenized as TRL's SFTTrainer does with
// the Python tokenizers library (tests/hf_model/fixtures/sft/tokenization.json, written by
// make_sft_fixtures.py): ids and prompt lengths equal, for a tokenizer that adds BOS (llama2)
// and one that adds nothing (qwen2); field names from the options.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "mdist/hf/tokenizer.h"
#include "src/cli/sft_examples.h"

namespace {

namespace fs = std::filesystem;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

class SftExamples : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("mdist-sft-examples-" + std::to_string(getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(SftExamples, TokenizedAsTrlWithTheTokenizersLibrary) {
  const auto fixture = nlohmann::json::parse(
      read_text(fs::path(MDIST_HF_MODEL_FIXTURES) / "sft" / "tokenization.json"));
  for (const auto& [family, examples] : fixture.at("families").items()) {
    const auto tokenizer =
        mdist::hf::Tokenizer::from_directory(fs::path(MDIST_TOKENIZER_FIXTURES) / family);
    // The fixture's pairs as a file, under other field names, with a blank line and CRLF.
    const auto path = dir_ / (family + ".jsonl");
    {
      std::ofstream out(path, std::ios::binary);
      for (const auto& example : examples) {
        out << nlohmann::json{{"q", example.at("prompt")}, {"a", example.at("completion")}}.dump()
            << "\r\n\n";
      }
    }
    mdist::cli::ModelDataOptions options;
    options.prompt_field = "q";
    options.completion_field = "a";
    const auto read = mdist::cli::read_sft_examples(path, tokenizer, options, 64, 1 << 20);
    ASSERT_EQ(read.size(), examples.size()) << family;
    for (std::size_t i = 0; i < read.size(); ++i) {
      EXPECT_EQ(read[i].ids, examples[i].at("ids").get<std::vector<std::int32_t>>())
          << family << " example " << i;
      EXPECT_EQ(read[i].prompt_tokens, examples[i].at("prompt_tokens").get<std::int64_t>())
          << family << " example " << i;
    }
  }
}

}  // namespace
