// Supervised fine-tuning batches against transformers (fixtures/sft/parity.json from
// make_sft_fixtures.py): the loss of padded batches (attention mask, prompt labels -100) and of
// packed ones (per-example position ids, no mask: the model masks attention per example) equals
// transformers' on the same batches, and a packed batch equals its padded one.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/config.h"

namespace {

using mdist::hf::CausalLM;
using mdist::hf::LlamaConfig;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string fixture_dir(const std::string& name) {
  return std::string(MDIST_HF_MODEL_FIXTURES) + "/" + name;
}

// The f16 weights of fixtures/<arch>/ (make_fixtures.py's manifest.json + tensors.bin).
CausalLM loaded(const std::string& arch) {
  const std::string dir = fixture_dir(arch);
  const auto manifest = nlohmann::json::parse(read_text(dir + "/manifest.json"));
  const std::string blob = read_text(dir + "/tensors.bin");
  std::map<std::string, at::Tensor> weights;
  for (const auto& entry : manifest.at("tensors")) {
    const auto name = entry.at("name").get<std::string>();
    if (entry.at("dtype") != "f16" || name.starts_with("fused:")) continue;
    at::Tensor t = torch::empty(entry.at("shape").get<std::vector<int64_t>>(), torch::kHalf);
    std::memcpy(t.data_ptr(), blob.data() + entry.at("offset").get<std::size_t>(),
                t.numel() * t.element_size());
    weights[name] = t;
  }
  CausalLM model(LlamaConfig::from_file(dir + "/config.json"));
  mdist::hf::load_state_dict(model, weights);
  model->eval();
  return model;
}

// A [rows, T] int64 tensor from nested JSON lists.
at::Tensor tensor_of(const nlohmann::json& rows) {
  const auto values = rows.get<std::vector<std::vector<int64_t>>>();
  at::Tensor t =
      torch::empty({static_cast<int64_t>(values.size()), static_cast<int64_t>(values.at(0).size())},
                   torch::kInt64);
  auto* out = t.data_ptr<int64_t>();
  for (const auto& row : values) out = std::copy(row.begin(), row.end(), out);
  return t;
}

const nlohmann::json& parity() {
  static const nlohmann::json fixture =
      nlohmann::json::parse(read_text(fixture_dir("sft") + "/parity.json"));
  return fixture;
}

// The loss of one stored batch ("padded": with its attention mask; "packed": with its position
// ids), as the trainer computes it.
double loss_of(CausalLM& model, const nlohmann::json& batch) {
  const torch::NoGradGuard no_grad;
  const at::Tensor ids = tensor_of(batch.at("input_ids"));
  const at::Tensor mask =
      batch.contains("attention_mask") ? tensor_of(batch.at("attention_mask")) : at::Tensor();
  const at::Tensor positions =
      batch.contains("position_ids") ? tensor_of(batch.at("position_ids")) : at::Tensor();
  const at::Tensor logits = model->forward(ids, mask, positions);
  return mdist::hf::causal_lm_loss(logits, tensor_of(batch.at("labels"))).item<double>();
}

class SftParity : public ::testing::TestWithParam<std::string> {};

TEST_P(SftParity, PaddedAndPackedLossesEqualTransformers) {
  const auto& entry = parity().at("archs").at(GetParam());
  CausalLM model = loaded(GetParam());
  const double padded = loss_of(model, entry.at("padded"));
  const double packed = loss_of(model, entry.at("packed"));
  EXPECT_NEAR(padded, entry.at("padded").at("loss").get<double>(), 1e-6);
  EXPECT_NEAR(packed, entry.at("packed").at("loss").get<double>(), 1e-6);
  EXPECT_NEAR(packed, padded, 1e-6);
  ASSERT_LT(entry.at("packed").at("input_ids").size(), entry.at("padded").at("input_ids").size());

  // Without its position ids the packed rows are one document each: another loss, so the
  // per-example mask is what made them equal.
  nlohmann::json unmasked = entry.at("packed");
  unmasked.erase("position_ids");
  EXPECT_GT(std::abs(loss_of(model, unmasked) - packed), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SftParity, ::testing::Values("llama", "qwen3", "qwen3_sliding"));

// Position ids without a break (0..T-1 in every row) are not packing: the logits are bit for
// bit those without position ids, as training without --packing was before.
TEST(SftPacking, PositionIdsWithoutABreakChangeNothing) {
  CausalLM model = loaded("qwen3_sliding");
  const torch::NoGradGuard no_grad;
  const at::Tensor ids = tensor_of(parity().at("archs").at("llama").at("packed").at("input_ids"));
  const at::Tensor plain = model->forward(ids);
  const at::Tensor positions = torch::arange(ids.size(1)).expand_as(ids);
  EXPECT_TRUE(torch::equal(model->forward(ids, {}, positions), plain));
}

// A packed row's documents attend only to themselves: each document's logits are those of
// the document alone, also under a sliding window shorter than the row.
TEST(SftPacking, EachDocumentOfAPackedRowIsComputedAlone) {
  CausalLM model = loaded("qwen3_sliding");
  const torch::NoGradGuard no_grad;
  const at::Tensor ids = torch::arange(3, 19).remainder(40).unsqueeze(0);  // [1, 16]
  const at::Tensor positions =
      torch::cat({torch::arange(7), torch::arange(9)}).unsqueeze(0);  // documents of 7 and 9
  const at::Tensor packed = model->forward(ids, {}, positions);
  const at::Tensor first = model->forward(ids.narrow(1, 0, 7));
  const at::Tensor second = model->forward(ids.narrow(1, 7, 9));
  EXPECT_LT((packed.narrow(1, 0, 7) - first).abs().max().item<double>(), 1e-5);
  EXPECT_LT((packed.narrow(1, 7, 9) - second).abs().max().item<double>(), 1e-5);
}

}  // namespace
