#include "mdist/hf/fsdp2_wrap.h"

#include <ATen/ATen.h>

#include <iomanip>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <typeinfo>

#include "mdist/error.h"
#include "mdist/nn/meta.h"
#include "mdist/runtime/device.h"
#include "mdist/runtime/runtime.h"
#include "src/hf/dtypes.h"

namespace mdist {
namespace {

std::shared_ptr<torch::nn::Module> child(const std::shared_ptr<torch::nn::Module>& module,
                                         const std::string& name) {
  for (const auto& item : module->named_children()) {
    if (item.key() == name) return item.value();
  }
  return nullptr;
}

std::shared_ptr<torch::nn::Module> path(std::shared_ptr<torch::nn::Module> module,
                                        const std::vector<std::string>& names) {
  for (const auto& name : names) {
    if (!module) return nullptr;
    module = child(module, name);
  }
  return module;
}

// The children of a layer container, if they are all of one module type.
std::vector<std::shared_ptr<torch::nn::Module>> homogeneous_children(
    const std::shared_ptr<torch::nn::Module>& container) {
  std::vector<std::shared_ptr<torch::nn::Module>> layers;
  if (!container) return layers;
  for (const auto& layer : container->children()) {
    if (!layers.empty() && typeid(*layer) != typeid(*layers.front())) return {};
    layers.push_back(layer);
  }
  return layers;
}

std::shared_ptr<torch::nn::Module> shared_of(torch::nn::Module& model) {
  try {
    return model.shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    // A module not held by a shared_ptr: a non-owning handle that is enough to walk it.
    return std::shared_ptr<torch::nn::Module>(&model, [](torch::nn::Module*) {});
  }
}

}  // namespace

std::vector<std::shared_ptr<torch::nn::Module>> get_decoder_layers(torch::nn::Module& model) {
  const auto root = shared_of(model);
  // The reference's walk: model -> language_model -> layers, each step taken when present.
  auto node = root;
  if (auto inner = child(node, "model")) node = inner;
  if (auto language = child(node, "language_model")) node = language;
  if (auto layers = homogeneous_children(child(node, "layers")); !layers.empty()) return layers;
  for (const auto& layout : std::vector<std::vector<std::string>>{{"transformer", "h"},
                                                                  {"gpt_neox", "layers"},
                                                                  {"model", "decoder", "layers"},
                                                                  {"backbone", "layers"}}) {
    if (auto layers = homogeneous_children(path(root, layout)); !layers.empty()) return layers;
  }
  return {};
}

std::vector<std::shared_ptr<torch::nn::Module>> fsdp2_wrap(
    torch::nn::Module& model, bool shard_root, const std::optional<MixedPrecisionPolicy>& mp_policy,
    bool cpu_offload, const Group& group) {
  auto layers = get_decoder_layers(model);
  if (layers.empty()) {
    throw Error(
        "Could not auto-detect decoder layers; FSDP2 wrap requires a standard HF causal-LM "
        "layout.");
  }
  // The dominant dtype by element count, not by parameter count: a few small fp32 norms do
  // not outvote one large bf16 embedding.
  const auto named = model.named_parameters();
  int64_t total = 0;
  for (const auto& item : named) total += item.value().numel();
  const c10::ScalarType dominant = hf::detail::dominant_dtype(
      named, [](const auto& item) -> const at::Tensor& { return item.value(); });

  FullyShardOptions options;
  options.group = group;
  options.reshard_after_forward = true;
  if (mp_policy) options.mp_policy = *mp_policy;
  if (cpu_offload) options.offload_policy = CPUOffloadPolicy{};
  // A model built on the meta device (see mdist/nn/meta.h), or one offloaded to the CPU,
  // computes where fully_shard would by default: on this rank's own device.
  const bool meta = nn::has_meta_tensors(model);
  const c10::Device device =
      cpu_offload || meta ? compute_device()
                          : (named.is_empty() ? c10::Device(c10::kCPU) : named[0].value().device());
  if (meta) options.device = device;
  std::vector<std::string> odd_names;
  int64_t odd_elements = 0;
  {
    const at::NoGradGuard no_grad;
    for (const auto& item : named) {
      at::Tensor param = item.value();
      if (param.scalar_type() == dominant) continue;
      // Replicated and whole: it must live where forward runs (from meta: uninitialised, for
      // a checkpoint to fill).
      if (param.is_meta()) {
        nn::assign_in_place(param, at::empty(param.sizes(), param.options().device(device)));
      } else if (param.device() != device) {
        param.set_data(param.data().to(device));
      }
      options.ignored_params.push_back(param);
      odd_names.push_back(item.key() + " (" + hf::detail::dtype_name(param.scalar_type()) + ")");
      odd_elements += param.numel();
    }
  }
  if (!odd_names.empty() && is_master()) {
    std::ostringstream warning;
    warning << "mdist: fsdp2_wrap: " << odd_names.size() << " parameter(s) differ from the model's "
            << hf::detail::dtype_name(dominant) << " and stay replicated and unsharded: ";
    for (std::size_t i = 0; i < odd_names.size() && i < 3; ++i) {
      warning << (i ? ", " : "") << odd_names[i];
    }
    if (odd_names.size() > 3) warning << ", ...";
    warning << " (" << std::fixed << std::setprecision(2)
            << (total > 0 ? 100.0 * static_cast<double>(odd_elements) / static_cast<double>(total)
                          : 0.0)
            << "% of the elements)";
    std::cerr << warning.str() << std::endl;
  }

  // What the layers leave to the root (found before wrapping: afterwards the layers'
  // parameters are new tensors, their shards).
  std::vector<at::Tensor> rest;
  {
    std::set<const c10::TensorImpl*> in_layers;
    for (const auto& layer : layers) {
      for (const auto& param : layer->parameters()) in_layers.insert(param.unsafeGetTensorImpl());
    }
    for (const auto& item : named) {
      if (!in_layers.contains(item.value().unsafeGetTensorImpl())) rest.push_back(item.value());
    }
  }
  // A layer whose parameters are all kept whole becomes a unit that only replicates them
  // (its gradients averaged over the ranks); fully_shard accepts that.
  for (const auto& layer : layers) {
    if (!layer->parameters().empty() && !fsdp_handle(*layer)) fully_shard(*layer, options);
  }
  // The root's unit shards the rest, or with shard_root=false keeps all of it whole and
  // replicated, so that its gradients are averaged too.
  if (!rest.empty()) {
    if (!shard_root) options.ignored_params = rest;
    fully_shard(model, options);
  }
  // What stays whole (the root's parameters without shard_root) gets, from meta, real
  // uninitialised memory on the compute device, as the replicated ones above.
  if (meta) nn::to_empty(model, device);
  return layers;
}

}  // namespace mdist
