// Loading a Hugging Face checkpoint straight into a sharded model: CausalLM built on the meta
// device (no storage), fsdp2_wrap on meta parameters, and load_pretrained_fsdp2, on 1-4 ranks.
// The loaded model must equal load_pretrained (unwrapped) and load_pretrained + fsdp2_wrap,
// with real shards only and no full parameter kept.
#include <gtest/gtest.h>

#include <torch/torch.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <ostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/hf/pretrained.h"
#include "mdist/hf/safetensors.h"
#include "mdist/mdist.h"

namespace {

using mdist::hf::CausalLM;
using mdist::hf::LlamaConfig;

LlamaConfig fixture_config(const std::string& arch) {
  return LlamaConfig::from_file(std::string(MDIST_HF_MODEL_FIXTURES) + "/" + arch + "/config.json");
}

// The tensors each module keeps as members (what its forward uses), by full name: after
// wrapping these are the full parameters, distinct from the shards parameters() yields.
std::vector<std::pair<std::string, at::Tensor>> member_tensors(CausalLM& model) {
  std::vector<std::pair<std::string, at::Tensor>> found;
  for (const auto& item : model->named_modules()) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(item.value().get())) {
      found.emplace_back(prefix + "weight", linear->weight);
      if (linear->bias.defined()) found.emplace_back(prefix + "bias", linear->bias);
    } else if (auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(item.value().get())) {
      found.emplace_back(prefix + "weight", embedding->weight);
    } else if (auto* norm = dynamic_cast<mdist::hf::RMSNormImpl*>(item.value().get())) {
      found.emplace_back(prefix + "weight", norm->weight);
    }
  }
  return found;
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
}

class MetaBuild : public ::testing::TestWithParam<std::string> {};

TEST_P(MetaBuild, EveryParameterIsOnMetaWithTheRealModelsNamesShapesAndModuleTypes) {
  const auto config = fixture_config(GetParam());
  CausalLM real(config);
  CausalLM meta(config, c10::kMeta);
  const auto real_params = real->named_parameters();
  const auto meta_params = meta->named_parameters();
  ASSERT_EQ(meta_params.size(), real_params.size());
  for (const auto& item : real_params) {
    const at::Tensor* m = meta_params.find(item.key());
    ASSERT_NE(m, nullptr) << item.key();
    EXPECT_TRUE(m->is_meta()) << item.key();
    EXPECT_EQ(m->sizes(), item.value().sizes()) << item.key();
    EXPECT_EQ(m->scalar_type(), item.value().scalar_type()) << item.key();
    EXPECT_TRUE(m->requires_grad()) << item.key();
  }
  EXPECT_TRUE(mdist::nn::has_meta_tensors(*meta));
  EXPECT_FALSE(mdist::nn::has_meta_tensors(*real));
  // The members forward uses are those same meta tensors, and the modules keep their types
  // and options (code finds "every Linear" by dynamic_cast).
  const auto members = member_tensors(meta);
  EXPECT_EQ(members.size(), meta_params.size());
  for (const auto& [name, tensor] : members) {
    const at::Tensor* registered = meta_params.find(name);
    ASSERT_NE(registered, nullptr) << name;
    EXPECT_EQ(tensor.unsafeGetTensorImpl(), registered->unsafeGetTensorImpl()) << name;
  }
  const auto& q_proj = meta->model->decoder_layers[0]->self_attn->q_proj;
  EXPECT_EQ(q_proj->options.in_features(), config.hidden_size);
  EXPECT_EQ(q_proj->options.out_features(), config.num_attention_heads * config.head_dim);
  EXPECT_EQ(meta->model->embed_tokens->options.num_embeddings(), config.vocab_size);
  EXPECT_EQ(meta->model->embed_tokens->options.padding_idx(), config.pad_token_id);
  // Not a parameter, computed on the CPU either way.
  EXPECT_FALSE(meta->model->rotary.inv_freq().is_meta());
  EXPECT_TRUE(torch::equal(meta->model->rotary.inv_freq(), real->model->rotary.inv_freq()));

  // Loading into meta parameters would silently do nothing: it is an error instead.
  std::map<std::string, at::Tensor> weights;
  for (const auto& item : real_params) weights[item.key()] = item.value();
  EXPECT_THROW(mdist::hf::load_state_dict(meta, weights), mdist::Error);
  try {
    mdist::hf::load_checkpoint_sharded(*meta, "/nonexistent/mdist-checkpoint");
    ADD_FAILURE() << "loaded into meta parameters";
  } catch (const mdist::Error& e) {
    EXPECT_NE(std::string(e.what()).find("meta device"), std::string::npos) << e.what();
  }
  EXPECT_THROW({ CausalLM on_gpu(config, c10::Device(c10::kCUDA, 0)); }, mdist::Error);
}

TEST(MetaTensors, ToEmptyGivesRealMemoryInPlaceAndToMetaTakesItAway) {
  torch::nn::Linear linear(torch::nn::LinearOptions(6, 4));
  const auto* impl = linear->weight.unsafeGetTensorImpl();
  mdist::nn::to_meta(*linear);
  EXPECT_TRUE(linear->weight.is_meta());
  EXPECT_TRUE(linear->bias.is_meta());
  EXPECT_EQ(linear->weight.unsafeGetTensorImpl(), impl);
  mdist::nn::to_empty(*linear, c10::kCPU);
  EXPECT_FALSE(mdist::nn::has_meta_tensors(*linear));
  EXPECT_EQ(linear->weight.unsafeGetTensorImpl(), impl);
  EXPECT_EQ(linear->weight.storage().nbytes(), 24 * sizeof(float));
  EXPECT_TRUE(linear->weight.requires_grad());
  // The member and the parameter table still agree, and the module runs and trains.
  {
    const at::NoGradGuard no_grad;
    linear->weight.fill_(0.5);
    linear->bias.zero_();
  }
  const at::Tensor out = linear(torch::ones({2, 6})).sum();
  EXPECT_DOUBLE_EQ(out.item<double>(), 2 * 4 * 3.0);
  out.backward();
  ASSERT_TRUE(linear->parameters()[0].grad().defined());
  EXPECT_DOUBLE_EQ(linear->parameters()[0].grad().sum().item<double>(), 2 * 24.0);

  const at::Tensor bare = mdist::nn::storageless({1000, 1000}, at::TensorOptions());
  EXPECT_EQ(bare.numel(), 1000 * 1000);
  EXPECT_EQ(bare.storage().nbytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Architectures, MetaBuild,
                         ::testing::Values("llama", "mistral", "qwen2", "qwen3"));

// A checkpoint written once per test by rank 0 from seeded weights (sharded into several files
// for qwen3), and removed at the end.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& arch) : config_(fixture_config(arch)) {
    dir_ = mdist::broadcast((std::filesystem::temp_directory_path() /
                             ("mdist-load-fsdp2-" + std::to_string(::getpid()) + "-" + arch))
                                .string());
    torch::manual_seed(23);
    CausalLM model(config_);
    const std::uint64_t shard_bytes = arch == "qwen3" ? (std::uint64_t{16} << 10) : (1u << 30);
    mdist::hf::save_pretrained(model, dir_, shard_bytes);
    mdist::barrier();
  }
  ~Checkpoint() {
    mdist::barrier();
    if (mdist::is_master()) std::filesystem::remove_all(dir_);
  }
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;
  const std::filesystem::path& dir() const { return dir_; }
  const LlamaConfig& config() const { return config_; }

 private:
  LlamaConfig config_;
  std::filesystem::path dir_;
};

struct Case {
  std::string arch;
  mdist::hf::Fsdp2LoadOptions options;
  std::string label;
};

void PrintTo(const Case& c, std::ostream* out) { *out << c.label; }

class LoadPretrainedFsdp2 : public ::testing::TestWithParam<Case> {};

TEST_P(LoadPretrainedFsdp2, EqualsLoadPretrainedWithRealShardsOnlyAndNoFullParameterKept) {
  const Case& c = GetParam();
  const Checkpoint checkpoint(c.arch);
  const auto& config = checkpoint.config();
  const int world = mdist::size();

  CausalLM unwrapped = mdist::hf::load_pretrained(checkpoint.dir());
  CausalLM reference = mdist::hf::load_pretrained(checkpoint.dir());
  mdist::fsdp2_wrap(*reference, c.options.shard_root, c.options.mp_policy, c.options.cpu_offload);
  CausalLM loaded = mdist::hf::load_pretrained_fsdp2(checkpoint.dir(), c.options).model;
  ASSERT_TRUE(mdist::is_fsdp2_model(*loaded));

  // What parameters() yields: real memory of exactly its own size (a shard, or a root
  // parameter kept whole without shard_root), never meta.
  const std::set<std::string> root_names = {"model.embed_tokens.weight", "model.norm.weight",
                                            "lm_head.weight"};
  for (const auto& item : loaded->named_parameters()) {
    const at::Tensor& t = item.value();
    EXPECT_FALSE(t.is_meta()) << item.key();
    EXPECT_TRUE(t.device().is_cpu()) << item.key();
    EXPECT_EQ(t.storage().nbytes(), static_cast<std::size_t>(t.numel() * t.element_size()))
        << item.key();
    const auto reference_param = reference->named_parameters()[item.key()];
    EXPECT_EQ(t.sizes(), reference_param.sizes()) << item.key();
    // Identical to load_pretrained + fsdp2_wrap, shard for shard.
    EXPECT_TRUE(torch::equal(t, reference_param)) << item.key();
    const bool whole = !c.options.shard_root && root_names.contains(item.key());
    const int64_t rows = unwrapped->named_parameters()[item.key()].size(0);
    EXPECT_EQ(t.size(0), whole ? rows : (rows + world - 1) / world) << item.key();
  }
  // The modules' own tensors (the full parameters) are real but hold no memory while
  // resharded, except the root's when it is not sharded.
  for (const auto& [name, tensor] : member_tensors(loaded)) {
    EXPECT_FALSE(tensor.is_meta()) << name;
    EXPECT_EQ(tensor.sizes(), unwrapped->named_parameters()[name].sizes()) << name;
    const bool whole = !c.options.shard_root && root_names.contains(name);
    EXPECT_EQ(tensor.storage().nbytes(),
              whole ? static_cast<std::size_t>(tensor.numel() * tensor.element_size()) : 0u)
        << name;
  }
  // Gathered, every parameter equals the checkpoint's.
  const auto full = mdist::full_state_dict(*loaded, {.rank0_only = false, .cpu = true});
  ASSERT_EQ(full.size(), unwrapped->named_parameters().size());
  for (const auto& item : unwrapped->named_parameters()) {
    ASSERT_TRUE(full.contains(item.key())) << item.key();
    EXPECT_TRUE(torch::equal(full.at(item.key()), item.value())) << item.key();
  }

  // The same logits and loss as the unwrapped model, and the same training step as the model
  // wrapped after a full load (autograd works on parameters that began on meta).
  torch::manual_seed(7);
  const at::Tensor ids = torch::randint(0, config.vocab_size, {2, 8});
  // With a compute dtype, the unwrapped model computes in it too.
  if (c.options.mp_policy) unwrapped->to(*c.options.mp_policy->param_dtype);
  const double tolerance = c.options.mp_policy ? 1e-2 : 1e-5;
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::AdamW opt(loaded->parameters(), torch::optim::AdamWOptions(1e-3));
  // One model's forward and backward at a time: the end of a backward finishes every
  // fully_shard unit in the process, so another model's pending backward would lose its
  // reduce-scatter.
  const auto train_step = [&](CausalLM& model, torch::optim::Optimizer& optimizer) {
    const at::Tensor logits = model->forward(ids);
    const at::Tensor loss = mdist::hf::causal_lm_loss(logits, ids);
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    return std::pair{logits.detach(), loss.item<double>()};
  };
  for (int step = 0; step < 2; ++step) {
    const auto [logits, loss] = train_step(loaded, opt);
    const auto [ref_logits, ref_loss] = train_step(reference, ref_opt);
    EXPECT_LT(max_diff(logits, ref_logits), 1e-6) << "step " << step;
    EXPECT_NEAR(loss, ref_loss, 1e-6) << "step " << step;
    if (step == 0) {
      const at::NoGradGuard no_grad;
      const at::Tensor plain_logits = unwrapped->forward(ids);
      EXPECT_LT(max_diff(logits, plain_logits), tolerance);
      EXPECT_NEAR(loss, mdist::hf::causal_lm_loss(plain_logits, ids).item<double>(), tolerance);
    }
  }
  for (const auto& item : loaded->named_parameters()) {
    EXPECT_LT(max_diff(item.value(), reference->named_parameters()[item.key()]), 1e-6)
        << item.key();
  }
}

std::vector<Case> cases() {
  std::vector<Case> all;
  for (const std::string arch : {"llama", "mistral", "qwen2", "qwen3"}) {
    all.push_back({arch, {}, arch});
  }
  mdist::hf::Fsdp2LoadOptions whole_root;
  whole_root.shard_root = false;
  all.push_back({"llama", whole_root, "llama_unsharded_root"});
  all.push_back({"qwen3", whole_root, "qwen3_unsharded_root"});
  mdist::hf::Fsdp2LoadOptions bf16;
  bf16.mp_policy.emplace();
  bf16.mp_policy->param_dtype = at::kBFloat16;
  bf16.mp_policy->reduce_dtype = at::kFloat;
  all.push_back({"qwen2", bf16, "qwen2_bf16_compute"});
  mdist::hf::Fsdp2LoadOptions offload;
  offload.cpu_offload = true;
  all.push_back({"llama", offload, "llama_cpu_offload"});
  return all;
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, LoadPretrainedFsdp2, ::testing::ValuesIn(cases()),
                         [](const auto& test) { return test.param.label; });

TEST(LoadPretrainedFsdp2Errors, AMissingCheckpointFailsOnEveryRank) {
  const std::filesystem::path missing = "/nonexistent/mdist-no-such-checkpoint";
  EXPECT_THROW(mdist::hf::load_pretrained_fsdp2(missing), mdist::Error);
  // A checkpoint that only some ranks can read: the others fail too rather than go on.
  const Checkpoint checkpoint("llama");
  const std::filesystem::path dir =
      mdist::rank() == mdist::size() - 1 && mdist::size() > 1 ? missing : checkpoint.dir();
  if (mdist::size() > 1) {
    try {
      mdist::hf::load_pretrained_fsdp2(dir);
      ADD_FAILURE() << "loaded although rank " << mdist::size() - 1 << " could not";
    } catch (const mdist::Error& e) {
      if (dir != missing) {
        EXPECT_NE(std::string(e.what()).find("other rank(s) failed"), std::string::npos)
            << e.what();
      }
    }
  }
  mdist::barrier();
}

// A checkpoint whose tensors do not fit the config is refused on every load path (whole,
// by rows into an unwrapped model, sharded, split over tensor-parallel ranks) with
// transformers' wording and the full shapes; an integer tensor is refused, a float16 one is
// converted, a tensor the model does not have is ignored (as transformers ignores it).
TEST(LoadPretrainedFsdp2Errors, TensorsThatDoNotFitTheConfigAreRefusedOnEveryPath) {
  const Checkpoint checkpoint("llama");
  const auto config = checkpoint.config();
  const std::filesystem::path base = checkpoint.dir();
  const std::filesystem::path dir = mdist::broadcast(base.string() + "-edited");
  const auto weights = [&] {
    const mdist::hf::SafetensorsCheckpoint file(base);
    std::map<std::string, at::Tensor> tensors;
    for (const auto& name : file.names()) tensors[name] = file.tensor(name).clone();
    return tensors;
  }();
  const auto write = [&](const std::map<std::string, at::Tensor>& tensors) {
    mdist::barrier();
    if (mdist::is_master()) {
      std::filesystem::remove_all(dir);
      std::filesystem::create_directories(dir);
      std::filesystem::copy_file(base / "config.json", dir / "config.json");
      mdist::hf::save_safetensors(dir / "model.safetensors", tensors, {{"format", "pt"}});
    }
    mdist::barrier();
  };
  const auto error_on_every_path = [&](const std::string& expected) {
    const auto check = [&](const char* path, const std::function<void()>& load) {
      try {
        load();
        ADD_FAILURE() << path << ": loaded";
      } catch (const mdist::Error& e) {
        EXPECT_NE(std::string(e.what()).find(expected), std::string::npos)
            << path << ": " << e.what();
      }
    };
    check("load_pretrained", [&] { (void)mdist::hf::load_pretrained(dir); });
    check("load_checkpoint_sharded, unwrapped", [&] {
      CausalLM model(config);
      mdist::hf::load_checkpoint_sharded(*model, dir);
    });
    check("load_pretrained_fsdp2", [&] { (void)mdist::hf::load_pretrained_fsdp2(dir); });
    if (mdist::size() > 1 && config.num_key_value_heads % mdist::size() == 0) {
      mdist::hf::Fsdp2LoadOptions split;
      split.parallel = mdist::make_parallel_state({.tensor_parallel = mdist::size()});
      check("tensor parallel", [&] { (void)mdist::hf::load_pretrained_fsdp2(dir, split); });
    }
  };
  const std::string embed = "model.embed_tokens.weight";
  const std::string norm = "model.layers.0.input_layernorm.weight";
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  const auto shape = [](const at::Tensor& t) {
    std::string text = "[";
    for (int64_t d = 0; d < t.dim(); ++d) text += (d ? ", " : "") + std::to_string(t.size(d));
    return text + "]";
  };

  auto edited = weights;
  edited[embed] = torch::cat({weights.at(embed), torch::zeros_like(weights.at(embed))});
  write(edited);
  error_on_every_path("size mismatch for '" + embed + "': copying a param with shape " +
                      shape(edited[embed]) + " from checkpoint, the shape in current model is " +
                      shape(weights.at(embed)));
  edited = weights;
  edited[q] = torch::cat({weights.at(q), weights.at(q)});
  write(edited);
  error_on_every_path("size mismatch for '" + q + "'");
  edited = weights;
  edited[norm] = weights.at(norm).reshape({-1, 1});
  write(edited);
  error_on_every_path("size mismatch for '" + norm + "': copying a param with shape " +
                      shape(edited[norm]) + " from checkpoint");
  edited = weights;
  edited[norm] = weights.at(norm).to(at::kInt);
  write(edited);
  error_on_every_path("'" + norm + "' is stored as I32; only floating-point tensors convert");

  // Float16 values convert exactly to the model's float32; an extra tensor is skipped.
  edited = weights;
  edited[norm] = weights.at(norm).to(at::kHalf);
  edited["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch::ones({4});
  write(edited);
  const CausalLM loaded = mdist::hf::load_pretrained(dir);
  EXPECT_TRUE(torch::equal(loaded->named_parameters()[norm],
                           weights.at(norm).to(at::kHalf).to(at::kFloat)));
  mdist::barrier();
  if (mdist::is_master()) std::filesystem::remove_all(dir);
}

}  // namespace
