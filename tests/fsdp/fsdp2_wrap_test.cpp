// get_decoder_layers on hand-built module trees of each layout, and fsdp2_wrap across real
// ranks (1-4) against an unwrapped model.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/mdist.h"
#include "tests/fsdp/hf_shaped_lm.h"
#include "tests/fsdp/tiny_transformer.h"
#include "tests/support/error_of.h"

namespace {

using mdist::testing::Block;
using mdist::testing::error_of;
using ::testing::HasSubstr;

// An empty module to build trees with.
struct NodeImpl : torch::nn::Module {};
TORCH_MODULE(Node);
struct OtherLayerImpl : torch::nn::Module {
  OtherLayerImpl() { register_module("fc", torch::nn::Linear(2, 2)); }
};
TORCH_MODULE(OtherLayer);

torch::nn::ModuleList blocks(int count) {
  torch::nn::ModuleList list;
  for (int i = 0; i < count; ++i) list->push_back(Block(8, 2, 16));
  return list;
}

// Registers `leaf` under the dotted `path` below `root`, creating empty nodes on the way.
void put(torch::nn::Module& root, const std::string& path,
         std::shared_ptr<torch::nn::Module> leaf) {
  torch::nn::Module* node = &root;
  std::string rest = path;
  for (auto dot = rest.find('.'); dot != std::string::npos; dot = rest.find('.')) {
    const std::string name = rest.substr(0, dot);
    rest = rest.substr(dot + 1);
    std::shared_ptr<torch::nn::Module> next;
    for (const auto& c : node->named_children()) {
      if (c.key() == name) next = c.value();
    }
    if (!next) next = node->register_module(name, Node());
    node = next.get();
  }
  node->register_module(rest, leaf);
}

TEST(DecoderLayers, EveryKnownLayout) {
  for (const std::string layout :
       {"layers", "model.layers", "model.language_model.layers", "language_model.layers",
        "transformer.h", "gpt_neox.layers", "model.decoder.layers", "backbone.layers"}) {
    auto root = Node();
    auto list = blocks(3);
    put(*root, layout, list.ptr());
    const auto layers = mdist::get_decoder_layers(*root);
    ASSERT_EQ(layers.size(), 3u) << layout;
    EXPECT_EQ(layers[1].get(), list[1].get()) << layout;
  }
}

TEST(DecoderLayers, NothingForMixedTypesOrUnknownLayouts) {
  auto mixed = Node();
  auto list = blocks(2);
  list->push_back(OtherLayer());
  put(*mixed, "model.layers", list.ptr());
  EXPECT_TRUE(mdist::get_decoder_layers(*mixed).empty());

  auto elsewhere = Node();
  put(*elsewhere, "encoder.blocks", blocks(2).ptr());
  EXPECT_TRUE(mdist::get_decoder_layers(*elsewhere).empty());
  EXPECT_EQ(error_of([&] { mdist::fsdp2_wrap(*elsewhere); }),
            "Could not auto-detect decoder layers; FSDP2 wrap requires a standard HF causal-LM "
            "layout.");
}

using CausalLm = mdist::testing::HfShapedLm;

CausalLm seeded() {
  torch::manual_seed(21);
  return CausalLm();
}

double loss_of(CausalLm& lm, const at::Tensor& ids) {
  const at::Tensor logits = lm->forward(ids.narrow(1, 0, 5));
  const at::Tensor loss =
      torch::cross_entropy_loss(logits.reshape({-1, 32}), ids.narrow(1, 1, 5).reshape({-1}));
  loss.backward();
  return loss.item<double>();
}

TEST(Fsdp2Wrap, ShardsEveryLayerAndTheRootAndComputesTheSame) {
  CausalLm reference = seeded();
  CausalLm lm = seeded();
  EXPECT_FALSE(mdist::is_fsdp2_model(*lm));
  const auto layers = mdist::fsdp2_wrap(*lm);
  EXPECT_TRUE(mdist::is_fsdp2_model(*lm));
  ASSERT_EQ(layers.size(), 3u);
  for (const auto& layer : layers) EXPECT_TRUE(mdist::fsdp_handle(*layer).has_value());
  ASSERT_TRUE(mdist::fsdp_handle(*lm).has_value());
  // The root manages the embedding, the final norm and the head.
  EXPECT_EQ(mdist::fsdp_handle(*lm)->managed_parameter_names().size(), 5u);

  torch::manual_seed(4);
  const at::Tensor ids = torch::randint(0, 32, {2, 6});
  const double expected = loss_of(reference, ids);
  const double got = loss_of(lm, ids);
  EXPECT_NEAR(got, expected, 1e-6 * expected);
}

TEST(Fsdp2Wrap, ShardRootFalseLeavesTheRootWhole) {
  CausalLm lm = seeded();
  mdist::fsdp2_wrap(*lm, /*shard_root=*/false);
  // The root's unit only replicates (its gradients are averaged); it shards nothing.
  const auto root = mdist::fsdp_handle(*lm);
  ASSERT_TRUE(root.has_value());
  EXPECT_TRUE(root->managed_parameter_names().empty());
  EXPECT_EQ(root->replicated_parameter_names(),
            (std::vector<std::string>{"model.embed_tokens.weight", "model.norm.weight",
                                      "model.norm.bias", "lm_head.weight", "lm_head.bias"}));
  EXPECT_EQ(lm->model->embed_tokens->weight.sizes(), (c10::IntArrayRef{32, 8}));
  EXPECT_EQ(lm->lm_head->weight.sizes(), (c10::IntArrayRef{32, 8}));
  EXPECT_TRUE(mdist::fsdp_handle(*lm->model->layers[0]).has_value());
}

// A layer as in mixture-of-experts models: bf16 weights and an fp32 router.
struct RoutedImpl : torch::nn::Module {
  RoutedImpl() {
    proj = register_module("proj", torch::nn::Linear(8, 8));
    up = register_module("up", torch::nn::Linear(8, 8));
    router = register_module("router", torch::nn::Linear(8, 8));
    proj->to(at::kBFloat16);
    up->to(at::kBFloat16);
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor gate = torch::sigmoid(mdist::nn::call(router, x.to(at::kFloat)));
    return mdist::nn::call(up, mdist::nn::call(proj, x)) * gate.to(x.scalar_type());
  }
  torch::nn::Linear proj{nullptr}, up{nullptr}, router{nullptr};
};
TORCH_MODULE(Routed);

TEST(Fsdp2Wrap, AnFp32RouterInBf16LayersStaysWholeAndRuns) {
  auto root = Node();
  torch::nn::ModuleList list;
  for (int i = 0; i < 2; ++i) list->push_back(Routed());
  put(*root, "model.layers", list.ptr());
  ::testing::internal::CaptureStderr();
  const auto layers = mdist::fsdp2_wrap(*root);
  const std::string warning = ::testing::internal::GetCapturedStderr();
  if (mdist::is_master()) {
    EXPECT_THAT(warning, HasSubstr("mdist: fsdp2_wrap: 4 parameter(s) differ from the model's "
                                   "bfloat16 and stay replicated and unsharded: "
                                   "model.layers.0.router.weight (float32), "
                                   "model.layers.0.router.bias (float32), "
                                   "model.layers.1.router.weight (float32), ... (33.33% of the "
                                   "elements)"));
  } else {
    EXPECT_EQ(warning, "");
  }
  for (const auto& layer : layers) {
    auto* routed = layer->as<RoutedImpl>();
    EXPECT_EQ(routed->router->weight.sizes(), (c10::IntArrayRef{8, 8}));
    EXPECT_EQ(routed->router->weight.scalar_type(), at::kFloat);
    EXPECT_TRUE(routed->router->weight.is_cpu());
    EXPECT_EQ(mdist::fsdp_handle(*layer)->managed_parameter_names(),
              (std::vector<std::string>{"proj.weight", "proj.bias", "up.weight", "up.bias"}));
    auto as_routed = std::dynamic_pointer_cast<RoutedImpl>(layer);
    const at::Tensor out = mdist::nn::call(as_routed, torch::randn({3, 8}).to(at::kBFloat16));
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  }
}

// Dominance is by element count: three small fp32 tensors lose to one large bf16, and the
// other way round.
struct CountImpl : torch::nn::Module {
  CountImpl(bool big_is_bf16) {
    big =
        register_parameter("big", torch::zeros({64, 8}, big_is_bf16 ? at::kBFloat16 : at::kFloat));
    for (int i = 0; i < 3; ++i) {
      small.push_back(
          register_parameter("small" + std::to_string(i),
                             torch::zeros({4}, big_is_bf16 ? at::kFloat : at::kBFloat16)));
    }
  }
  at::Tensor big;
  std::vector<at::Tensor> small;
};
TORCH_MODULE(Count);

TEST(Fsdp2Wrap, DominantDtypeIsByElementCount) {
  for (const bool big_is_bf16 : {true, false}) {
    auto root = Node();
    torch::nn::ModuleList list;
    list->push_back(Count(big_is_bf16));
    put(*root, "layers", list.ptr());
    ::testing::internal::CaptureStderr();
    const auto layers = mdist::fsdp2_wrap(*root, /*shard_root=*/false);
    ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(mdist::fsdp_handle(*layers[0])->managed_parameter_names(),
              std::vector<std::string>{"big"});
  }
}

}  // namespace
