#pragma once
// The PTQ fixtures of make_ptq_fixtures.py (modelopt 0.47's mtq.quantize of tiny HF models),
// shared by the single-process and the multi-rank tests.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "mdist/hf/safetensors.h"
#include "mdist/quant/quantize.h"

namespace mdist::quant::testing {

// "llama" -> fixtures/ptq_llama; the AWQ fixtures (make_awq_fixtures.py) are named in full,
// "awq_llama".
inline std::filesystem::path fixture_dir(const std::string& arch) {
  const auto root = std::filesystem::path(MDIST_QUANT_FIXTURES);
  return arch.starts_with("awq_") ? root / arch : root / ("ptq_" + arch);
}

class PtqFixture {
 public:
  // `file`: make_ptq_fixtures.py's expected.safetensors, or make_kv_fixtures.py's
  // expected_kv.safetensors (the same keys; its batches are expected.safetensors').
  explicit PtqFixture(const std::string& arch, const std::string& file = "expected.safetensors")
      : file_(fixture_dir(arch) / file) {}

  at::Tensor tensor(const std::string& name) const { return file_.tensor(name).clone(); }
  bool contains(const std::string& name) const { return file_.contains(name); }
  int64_t batches() const { return file_.info("calib").shape.front(); }
  at::Tensor batch(int64_t index) const { return tensor("calib")[index]; }
  at::Tensor eval_ids() const { return tensor("eval_ids"); }

  // A comma-separated metadata entry.
  std::vector<std::string> list(const std::string& key) const {
    std::vector<std::string> items;
    std::stringstream in(file_.metadata().at(key));
    for (std::string item; std::getline(in, item, ',');) items.push_back(item);
    return items;
  }

  // "<preset>.<quantizer>._amax" entries of the fixture, keyed without the preset prefix.
  std::map<std::string, at::Tensor> amax(const std::string& preset) const {
    return buffers(preset, "._amax");
  }
  // "<preset>.<quantizer>._pre_quant_scale" entries (SmoothQuant), keyed likewise.
  std::map<std::string, at::Tensor> pre_quant_scales(const std::string& preset) const {
    return buffers(preset, "._pre_quant_scale");
  }

 private:
  std::map<std::string, at::Tensor> buffers(const std::string& preset,
                                            const std::string& suffix) const {
    std::map<std::string, at::Tensor> out;
    const std::string prefix = preset + ".";
    for (const auto& name : file_.names()) {
      // "int8.<...>" must not take "int8_sq.<...>": the prefix includes the dot.
      if (name.rfind(prefix, 0) == 0 && name.ends_with(suffix)) {
        out.emplace(name.substr(prefix.size()), tensor(name));
      }
    }
    return out;
  }

 public:
 private:
  hf::SafetensorsFile file_;
};

// A forward loop over the fixture's calibration batches `indices` (each rank its own share).
inline ForwardLoop forward_batches(const PtqFixture& fixture, std::vector<int64_t> indices) {
  return [&fixture, indices](hf::CausalLM& model) {
    const torch::NoGradGuard no_grad;
    for (const int64_t i : indices) model->forward(fixture.batch(i));
  };
}

inline double relative(double actual, double expected) {
  return std::abs(actual - expected) / std::abs(expected);
}

// The same shape and every value within `tolerance` relative (SmoothQuant's scales: fp32
// pow and division, which libtorch and PyTorch may vectorise differently).
inline ::testing::AssertionResult close_values(const at::Tensor& actual, const at::Tensor& expected,
                                               double tolerance) {
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << "shape " << actual.sizes() << " vs " << expected.sizes();
  }
  const at::Tensor a = actual.to(at::kDouble), e = expected.to(at::kDouble);
  const double worst = ((a - e).abs() / e.abs()).max().item<double>();
  if (!(worst <= tolerance)) {
    return ::testing::AssertionFailure() << "max relative difference " << worst;
  }
  return ::testing::AssertionSuccess();
}

// Bit-exact: the same shape and values (compared in fp32; modelopt's fp32 amax).
inline ::testing::AssertionResult same_values(const at::Tensor& actual,
                                              const at::Tensor& expected) {
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << "shape " << actual.sizes() << " vs " << expected.sizes();
  }
  const at::Tensor a = actual.to(at::kFloat), e = expected.to(at::kFloat);
  if (!at::equal(a, e)) {
    return ::testing::AssertionFailure()
           << (a != e).sum().item<int64_t>() << " of " << a.numel()
           << " differ, max relative difference " << ((a - e).abs() / e.abs()).max().item<double>();
  }
  return ::testing::AssertionSuccess();
}

inline nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// The same tensor bytes: dtype, shape and every byte of the data.
inline ::testing::AssertionResult same_bytes(const at::Tensor& actual, const at::Tensor& expected) {
  if (actual.scalar_type() != expected.scalar_type() || actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure() << actual.scalar_type() << actual.sizes() << " vs "
                                         << expected.scalar_type() << expected.sizes();
  }
  const at::Tensor a = actual.contiguous(), e = expected.contiguous();
  if (std::memcmp(a.data_ptr(), e.data_ptr(), a.nbytes()) != 0) {
    const at::Tensor differ = a.to(at::kFloat) != e.to(at::kFloat);
    return ::testing::AssertionFailure()
           << differ.sum().item<int64_t>() << " of " << a.numel() << " elements differ";
  }
  return ::testing::AssertionSuccess();
}

// The export in `out` against modelopt's export_hf_checkpoint fixture: every tensor's dtype,
// shape and bytes; hf_quant_config.json and config.json's quantization_config as JSON, the
// producer's version aside. `input_scale_tolerance` > 0: input scales (from activation amaxes)
// within that relative difference instead of equal (a layout that sums in another order).
inline void expect_export_equals_modelopt(const std::filesystem::path& out, const std::string& arch,
                                          const std::string& preset,
                                          double input_scale_tolerance = 0.0) {
  const auto expected_dir = fixture_dir(arch) / ("export_" + preset);
  const hf::SafetensorsFile expected(expected_dir / "model.safetensors");
  const hf::SafetensorsFile actual(out / "model.safetensors");
  EXPECT_EQ(actual.names(), expected.names());
  for (const auto& name : expected.names()) {
    if (!actual.contains(name)) continue;
    if (input_scale_tolerance > 0.0 && name.ends_with(".input_scale")) {
      const double a = actual.tensor(name).item<double>(), e = expected.tensor(name).item<double>();
      EXPECT_LE(std::abs(a - e) / e, input_scale_tolerance) << name;
      continue;
    }
    EXPECT_TRUE(same_bytes(actual.tensor(name), expected.tensor(name))) << name;
  }
  auto hf_quant = read_json(out / "hf_quant_config.json");
  auto modelopt_hf_quant = read_json(expected_dir / "hf_quant_config.json");
  EXPECT_EQ(hf_quant["producer"]["name"], modelopt_hf_quant["producer"]["name"]);
  hf_quant.erase("producer");
  modelopt_hf_quant.erase("producer");
  EXPECT_EQ(hf_quant, modelopt_hf_quant);
  auto config = read_json(out / "config.json").at("quantization_config");
  auto modelopt_config = read_json(expected_dir / "config.json").at("quantization_config");
  config["producer"].erase("version");
  modelopt_config["producer"].erase("version");
  EXPECT_EQ(config, modelopt_config);
}

// mdist's amax_state_dict() under modelopt's names for transformers 5's fused experts
// (_QuantFusedExperts): a block's "<p>.experts.E.{gate,up}_proj.input_quantizer._amax" become
// its one "<p>.experts.gate_up_proj_input_quantizer._amax" (and down_proj's likewise), an
// expert's gate_proj and up_proj weight amaxes its "<p>.experts.gate_up_proj_weight_quantizers.
// E._amax" (one number shared by both, or per row the gate rows then the up rows). Every other
// name stays. `problems` gets a line for each amax that should be shared and is not.
inline std::map<std::string, at::Tensor> with_fused_expert_names(
    const std::map<std::string, at::Tensor>& amax, std::vector<std::string>& problems) {
  std::map<std::string, at::Tensor> out;
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> gate_up;  // fused name -> gate, up
  const auto put = [&](const std::string& name, const at::Tensor& value) {
    const auto [it, first] = out.emplace(name, value);
    if (!first && !at::equal(it->second.to(at::kFloat), value.to(at::kFloat))) {
      problems.push_back(name + " differs between the experts sharing it");
    }
  };
  for (const auto& [name, value] : amax) {
    const auto experts = name.find(".experts.");
    if (experts == std::string::npos) {
      out.emplace(name, value);
      continue;
    }
    const std::string block = name.substr(0, experts + 8);  // "<p>.experts"
    const std::string rest = name.substr(experts + 9);      // "E.gate_proj.input_quantizer._amax"
    const std::string expert = rest.substr(0, rest.find('.'));
    const std::string projection =
        rest.substr(expert.size() + 1, rest.find('.', expert.size() + 1) - expert.size() - 1);
    const bool input = rest.ends_with(".input_quantizer._amax");
    const std::string fused = projection == "down_proj" ? "down_proj" : "gate_up_proj";
    if (input) {
      put(block + "." + fused + "_input_quantizer._amax", value);
    } else if (projection == "down_proj") {
      out.emplace(block + ".down_proj_weight_quantizers." + expert + "._amax", value);
    } else {
      auto& pair = gate_up[block + ".gate_up_proj_weight_quantizers." + expert + "._amax"];
      (projection == "gate_proj" ? pair.first : pair.second) = value;
    }
  }
  for (const auto& [name, pair] : gate_up) {
    if (!pair.first.defined() || !pair.second.defined()) {
      problems.push_back(name + " lacks gate_proj's or up_proj's amax");
      continue;
    }
    if (pair.first.numel() == 1) {
      if (!at::equal(pair.first, pair.second)) problems.push_back(name + ": gate and up differ");
      out.emplace(name, pair.first);
    } else {
      out.emplace(name, at::cat({pair.first, pair.second}, 0));
    }
  }
  return out;
}

}  // namespace mdist::quant::testing
