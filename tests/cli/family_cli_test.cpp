// Phi-3, OLMo 2, Gemma 2 and Gemma 3 through `mdist` end to end (real processes through
// mdistrun): FSDP2 over 2 and 4 ranks and --tp 2 train as one process, --tp is refused naming
// the module that cannot split (KV heads shared by ranks in Phi-3's fused qkv_proj and OLMo
// 2's full-width k norm), and calibration names the Linears as modelopt does (Phi-3's fused
// qkv_proj and gate_up_proj).
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "mdist/hf/safetensors.h"
#include "tests/cli/mdist_command.h"
#include "tests/support/subprocess.h"

namespace {

namespace fs = std::filesystem;
using mdist::testing::error_lines;
using mdist::testing::MdistCommand;
using mdist::testing::RunResult;
using ::testing::HasSubstr;
using ::testing::Not;

class MdistFamilies : public MdistCommand {
 protected:
  // A seeded model directory in dir_/NAME written by mdist's save_pretrained: byte vocabulary,
  // hidden 32, 2 layers. Phi-3: longrope with the pretraining length 16 (the 32-token
  // sequences take the long factors), partial rotary 0.5, a window of 24. OLMo 2: as its
  // config class, with q/k/v/o bias. Gemma 2: head_dim 16 (not hidden / heads),
  // query_pre_attn_scalar 12, soft-capping 5 (scores) and 10 (logits), layer 0 sliding (window
  // 24), tied head. Gemma 3: q/k norms, sliding_window_pattern 2 (layer 0 sliding), linear RoPE
  // scaling on the full layer and theta 1e4 on the sliding one.
  // `kv_heads`: num_key_value_heads (the directory is then NAME-kvN).
  fs::path model(const std::string& name, int kv_heads = 2) {
    const std::string dir_name = name + (kv_heads == 2 ? "" : "-kv" + std::to_string(kv_heads));
    const auto config_dir = dir_ / (dir_name + "-config");
    fs::create_directories(config_dir);
    const std::string common =
        R"("hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": )" +
        std::to_string(kv_heads) + R"(, "vocab_size": 256,
           "pad_token_id": 0, "max_position_embeddings": 64)";
    const std::string gemma = common + R"(, "head_dim": 16, "query_pre_attn_scalar": 12,
           "sliding_window": 24)";
    std::string config;
    if (name == "phi3") {
      config = R"({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", )" + common +
               R"(, "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5,
               "sliding_window": 24, "rope_scaling": {"type": "longrope",
               "short_factor": [1.0, 1.3], "long_factor": [1.5, 6.0]}})";
    } else if (name == "olmo2") {
      config = R"({"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", )" + common +
               R"(, "attention_bias": true})";
    } else if (name == "gemma2") {
      config = R"({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", )" + gemma +
               R"(, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0})";
    } else {
      config = R"({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", )" + gemma +
               R"(, "sliding_window_pattern": 2, "rope_parameters": {
               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}})";
    }
    std::ofstream(config_dir / "config.json") << config << "\n";
    const auto out = dir_ / dir_name;
    const auto r =
        mdist::testing::run({MDIST_SAVE_FOR_TRANSFORMERS, config_dir.string(), out.string()});
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    return out;
  }

  static std::vector<double> losses(const fs::path& run) {
    std::vector<double> out;
    for (const auto& line : metrics(run)) out.push_back(line["loss"].get<double>());
    return out;
  }

  static std::string architecture(const std::string& name) {
    if (name == "phi3") return "Phi3ForCausalLM";
    if (name == "olmo2") return "Olmo2ForCausalLM";
    return name == "gemma2" ? "Gemma2ForCausalLM" : "Gemma3ForCausalLM";
  }

  // The largest relative difference of two runs' losses (of the same number of steps).
  static double gap(const std::vector<double>& a, const std::vector<double>& b) {
    EXPECT_EQ(a.size(), b.size());
    double worst = 0;
    for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      worst = std::max(worst, std::abs(a[i] - b[i]) / std::abs(a[i]));
    }
    return worst;
  }
};

// 5 AdamW steps on 2 and 4 ranks (FSDP2: each decoder layer a unit, then the root) give one
// process's losses (1e-5 relative).
TEST_F(MdistFamilies, TwoAndFourRanksWithFsdp2TrainAsOneProcess) {
  for (const std::string name : {"phi3", "olmo2", "gemma2", "gemma3"}) {
    const auto dir = model(name);
    std::vector<std::vector<double>> runs;
    for (const int ranks : {1, 2, 4}) {
      const auto out = dir_ / (name + "-np" + std::to_string(ranks));
      const RunResult r = mdist(
          ranks, train_args({"--model", dir.string(), "--steps", "5", "--out", out.string()}));
      ASSERT_EQ(r.exit_code, 0) << describe(r);
      EXPECT_THAT(r.out, HasSubstr("(" + architecture(name) + ")"));
      runs.push_back(losses(out));
      ASSERT_EQ(runs.back().size(), 5u) << name;
    }
    const double worst = std::max(gap(runs[0], runs[1]), gap(runs[0], runs[2]));
    EXPECT_LT(worst, 1e-5) << name;
    EXPECT_LT(runs[0].back(), runs[0].front()) << name;  // it trains
    std::cout << name << ": 2 and 4 ranks' losses within " << worst << " (relative) of 1 rank's\n";
  }
}

// --tp 2 gives one process's losses over 5 steps (1e-5 relative). Gemma splits as Llama (the
// sandwich norms replicated, Gemma 3's per-head q/k norms on each rank's heads; the logit
// soft-capping is elementwise, so it applies to each rank's vocabulary slice); Phi-3's fused
// qkv_proj by q, k and v heads and gate_up_proj by halves; OLMo 2's full-width q/k norms by
// their features, the sum of squares all-reduced over the tensor-parallel ranks.
// Phi-3's and OLMo 2's --tp 2 checkpoint of step 3 (the optimizer state of the fused weights
// written per row range, the norm weights by rows) resumes on one rank with the same losses.
TEST_F(MdistFamilies, TensorParallelismTrainsAsOneProcess) {
  for (const std::string name : {"phi3", "olmo2", "gemma2", "gemma3"}) {
    const auto dir = model(name);
    std::vector<std::vector<double>> runs;
    const std::vector<std::string> args = {"--model", dir.string(),   "--steps",
                                           "5",       "--save-every", "3"};
    for (const int tp : {1, 2}) {
      const auto out = dir_ / (name + "-tp" + std::to_string(tp));
      const RunResult r =
          mdist(tp, train_args(with(args, {"--tp", std::to_string(tp), "--out", out.string()})));
      ASSERT_EQ(r.exit_code, 0) << describe(r);
      runs.push_back(losses(out));
      ASSERT_EQ(runs.back().size(), 5u) << name;
    }
    const double worst = gap(runs[0], runs[1]);
    EXPECT_LT(worst, 1e-5) << name;
    std::cout << name << ": --tp 2 losses within " << worst << " (relative) of 1 rank's\n";
    if (name != "phi3" && name != "olmo2") continue;
    const auto cut = dir_ / (name + "-tp2-resumed");
    fs::copy(dir_ / (name + "-tp2"), cut, fs::copy_options::recursive);
    fs::remove_all(cut / "checkpoints" / "step-00000005");
    std::ofstream(cut / "checkpoints" / "latest") << "step-00000003\n";
    const RunResult r = mdist(
        1, train_args({"--steps", "5", "--save-every", "3", "--out", cut.string(), "--resume"}));
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    const std::vector<double> resumed = losses(cut);
    ASSERT_EQ(resumed.size(), 5u) << name;
    for (std::size_t i = 3; i < 5; ++i) {
      EXPECT_NEAR(resumed[i], runs[1][i], 1e-5 * runs[1][i]) << name << " resumed, step " << i + 1;
    }
  }
}

// --tp: one line naming the module that cannot split, exit code 2, nothing written: one KV
// head cannot be cut into Phi-3's fused qkv_proj of two ranks, nor OLMo 2's k norm over it.
TEST_F(MdistFamilies, TensorParallelismIsRefusedNamingTheModule) {
  const struct {
    std::string name, message;
  } cases[] = {
      {"phi3",
       "mdist train: error: --tp 2: cannot split the model over 2 tensor-parallel ranks: "
       "num_key_value_heads 1 does not divide by 2 (Phi3ForCausalLM's fused self_attn.qkv_proj "
       "splits by whole KV heads per rank)"},
      {"olmo2",
       "mdist train: error: --tp 2: cannot split the model over 2 tensor-parallel ranks: "
       "num_key_value_heads 1 does not divide by 2 (Olmo2ForCausalLM's self_attn.k_norm over all "
       "KV heads splits by whole KV heads per rank)"},
  };
  for (const auto& c : cases) {
    const auto dir = model(c.name, 1);
    const auto out = dir_ / (c.name + "-tp");
    const RunResult r = mdist(2, train_args({"--model", dir.string(), "--steps", "2", "--tp", "2",
                                             "--out", out.string()}));
    EXPECT_EQ(r.exit_code, 2) << describe(r);
    EXPECT_THAT(r.err, HasSubstr(c.message)) << describe(r);
    EXPECT_EQ(error_lines(r.err), 1) << describe(r);
    EXPECT_THAT(r.err, Not(HasSubstr("[rank1]"))) << describe(r);
    EXPECT_FALSE(fs::exists(out)) << c.name;
  }
}

// Gemma configs mdist cannot run: one line from rank 0 naming the key, exit code 2, nothing
// written.
TEST_F(MdistFamilies, UnsupportedGemmaConfigsAreOneLineAndWriteNothing) {
  const std::string common =
      R"("hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256)";
  const struct {
    std::string name, config, message;
  } cases[] = {
      {"bidirectional",
       R"({"architectures": ["Gemma3ForCausalLM"], )" + common +
           R"(, "use_bidirectional_attention": true})",
       "use_bidirectional_attention=true is not supported for Gemma3ForCausalLM"},
      {"activation",
       R"({"architectures": ["Gemma2ForCausalLM"], )" + common +
           R"(, "hidden_activation": "gelu"})",
       "unsupported hidden_activation 'gelu' for Gemma2ForCausalLM"},
      {"flat-rope",
       R"({"architectures": ["Gemma3ForCausalLM"], )" + common +
           R"(, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})",
       "rope_parameters of Gemma3ForCausalLM must be one object per layer type"},
  };
  for (const auto& c : cases) {
    const auto dir = dir_ / ("bad-" + c.name);
    fs::create_directories(dir);
    std::ofstream(dir / "config.json") << c.config << "\n";
    const auto out = dir_ / ("bad-" + c.name + "-out");
    const RunResult r =
        mdist(2, train_args({"--model", dir.string(), "--steps", "1", "--out", out.string()}));
    EXPECT_EQ(r.exit_code, 2) << describe(r);
    EXPECT_THAT(r.err, HasSubstr("[rank0]: mdist train: error: model directory")) << describe(r);
    EXPECT_THAT(r.err, HasSubstr(c.message)) << describe(r);
    EXPECT_EQ(error_lines(r.err), 1) << describe(r);
    EXPECT_FALSE(fs::exists(out)) << c.name;
  }
}

// int8 (per-row weight scales) export of Phi-3 with --tp 2 equals one process's: the fused
// qkv_proj's and gate_up_proj's per-row amax are gathered from each rank's row ranges back into
// the checkpoint's rows. Weights and weight scales bit for bit; input scales (activation maxima,
// summed in another order under tensor parallelism) 1e-6 relative.
TEST_F(MdistFamilies, Phi3Int8ExportWithTensorParallelismEqualsOneProcess) {
  const auto dir = model("phi3");
  std::vector<fs::path> outs;
  for (const int tp : {1, 2}) {
    outs.push_back(dir_ / ("phi3-int8-tp" + std::to_string(tp)));
    const RunResult r = mdist(tp, {"quantize", "--model", dir.string(), "--format", "int8",
                                   "--seq-len", "32", "--calib-sequences", "8", "--eval-sequences",
                                   "4", "--tp", std::to_string(tp), "--out", outs.back().string()});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
  }
  const mdist::hf::SafetensorsFile one(outs[0] / "model.safetensors");
  const mdist::hf::SafetensorsFile two(outs[1] / "model.safetensors");
  ASSERT_EQ(one.names(), two.names());
  int checked = 0;
  for (const std::string& name : one.names()) {
    const at::Tensor a = one.tensor(name), b = two.tensor(name);
    ASSERT_EQ(a.sizes(), b.sizes()) << name;
    if (name.ends_with("input_scale")) {
      EXPECT_LE((a - b).abs().max().item<double>(), 1e-6 * a.abs().max().item<double>()) << name;
    } else {
      EXPECT_TRUE(at::equal(a, b)) << name;
    }
    checked += name.find("qkv_proj.weight_scale") != std::string::npos;
  }
  EXPECT_EQ(checked, 2);  // a per-row scale per layer's fused qkv_proj
}

// Calibration records every Linear under its module name, as modelopt names its quantizers:
// Phi-3's fused projections are one Linear each.
TEST_F(MdistFamilies, CalibrationNamesTheLinearsAsModelopt) {
  const struct {
    std::string name;
    std::vector<std::string> per_layer;
  } cases[] = {
      {"phi3", {"mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj", "self_attn.qkv_proj"}},
      {"olmo2",
       {"mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
        "self_attn.q_proj", "self_attn.v_proj"}},
      {"gemma2",
       {"mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
        "self_attn.q_proj", "self_attn.v_proj"}},
  };
  for (const auto& c : cases) {
    const auto dir = model(c.name);
    const auto out = dir_ / (c.name + ".json");
    const RunResult r = mdist(2, {"calibrate", "--model", dir.string(), "--seq-len", "32",
                                  "--max-sequences", "4", "--out", out.string()});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    const auto result = nlohmann::json::parse(read(out));
    std::set<std::string> names, expected = {"lm_head"};
    for (const auto& [name, stats] : result.at("modules").items()) names.insert(name);
    for (const int layer : {0, 1}) {
      for (const auto& module : c.per_layer) {
        expected.insert("model.layers." + std::to_string(layer) + "." + module);
      }
    }
    EXPECT_EQ(names, expected) << c.name;
  }
}

}  // namespace
