#pragma once
// Reading the parity fixtures make_fixtures.py, make_rope_fixtures.py, make_family_fixtures.py
// and make_generate_fixtures.py write under tests/hf_model/fixtures/<name>/: manifest.json names,
// dtypes, shapes and offsets into tensors.bin (raw little-endian; the readers assume a
// little-endian host). Shared by the parity tests that compile MDIST_HF_MODEL_FIXTURES in.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace mdist::test {

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

inline std::string fixture_dir(const std::string& name) {
  return std::string(MDIST_HF_MODEL_FIXTURES) + "/" + name;
}

inline std::map<std::string, at::Tensor> read_fixture(const std::string& dir) {
  const auto manifest = nlohmann::json::parse(read_text(dir + "/manifest.json"));
  const std::string blob = read_text(dir + "/tensors.bin");
  std::map<std::string, at::Tensor> tensors;
  for (const auto& entry : manifest.at("tensors")) {
    const auto dtype = entry.at("dtype").get<std::string>();
    const auto scalar = dtype == "f16" ? at::kHalf : dtype == "f32" ? at::kFloat : at::kLong;
    at::Tensor t = torch::empty(entry.at("shape").get<std::vector<int64_t>>(),
                                torch::TensorOptions().dtype(scalar));
    const auto offset = entry.at("offset").get<std::size_t>();
    const std::size_t bytes = t.numel() * t.element_size();
    EXPECT_LE(offset + bytes, blob.size()) << entry.dump();
    if (offset + bytes <= blob.size()) std::memcpy(t.data_ptr(), blob.data() + offset, bytes);
    tensors[entry.at("name").get<std::string>()] = t;
  }
  return tensors;
}

// The model's weights among a fixture's tensors (the rest are inputs and expected outputs).
inline bool is_weight(const std::string& name) {
  return name.starts_with("model.") || name.starts_with("lm_head.");
}

inline std::map<std::string, at::Tensor> weights_of(
    const std::map<std::string, at::Tensor>& fixture) {
  std::map<std::string, at::Tensor> weights;
  for (const auto& [name, t] : fixture) {
    if (is_weight(name)) weights[name] = t;
  }
  return weights;
}

}  // namespace mdist::test
