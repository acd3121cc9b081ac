// `mdist calibrate`: post-training-quantization calibration, as modelopt's max calibration.
// Forward-only passes over data split across the data-parallel group record, for every
// Linear, the absolute max of its input and of its weight; each rank's maxima are synced with
// get_dist_syncd_obj (max) over the ParallelState's data-parallel group, then over its
// tensor-parallel group (a column-parallel layer's weight, a row-parallel layer's input and
// weight are split over it: modelopt's rule syncs both amaxes of both kinds over TP), and
// written as JSON keyed by the HF module names, whatever the layout.
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <utility>

#include "mdist/groups/parallel_state.h"
#include "mdist/hf/safetensors.h"
#include "mdist/nn/hooks.h"
#include "mdist/runtime/runtime.h"
#include "src/cli/commands.h"
#include "src/cli/forward_split.h"
#include "src/cli/job.h"

namespace mdist::cli {
namespace {

// module name -> (input abs max, weight abs max)
using AbsMax = std::map<std::string, std::pair<double, double>>;

AbsMax elementwise_max(const std::vector<AbsMax>& per_rank) {
  AbsMax result;
  for (const auto& stats : per_rank) {
    for (const auto& [name, value] : stats) {
      auto& slot = result[name];
      slot.first = std::max(slot.first, value.first);
      slot.second = std::max(slot.second, value.second);
    }
  }
  return result;
}

}  // namespace

int run_calibrate(const CalibrateOptions& o) {
  const Session session(setup_options(o.io.timeout_s));
  configure_threads();
  ModelChoice choice;
  TokenStream data;
  agree_on_inputs([&] {
    check_at_least(o.max_sequences, 0, "--max-sequences");
    check_writable_file(o.out, "output file");
    check_tensor_parallel_size(o.io.tensor_parallel);
    choice = model_for_inference(o.io.model_dir, o.default_run);
    check_tensor_parallel(o.io.tensor_parallel, choice.config);
    data = load_checked_data(o.io, DataSplit::train, choice, "calibrate");
  });
  const Windows windows(data, o.io.seq_len, "calibrate");
  const ParallelState parallel = make_layout(o.io.tensor_parallel);
  hf::CausalLM model = build_wrapped_model(choice, o.io.seed, parallel);
  model->eval();
  const torch::NoGradGuard no_grad;
  const c10::Device device = compute_device();

  AbsMax stats;
  bool recording = true;
  std::vector<nn::HookHandle> hooks;
  for (const auto& item : model->named_modules("", /*include_self=*/false)) {
    auto* linear = dynamic_cast<torch::nn::LinearImpl*>(item.value().get());
    if (linear == nullptr) continue;
    stats[item.key()] = {0.0, 0.0};
    // A pre-hook: the module's weight is whole here (its FSDP unit has gathered it).
    hooks.push_back(nn::register_forward_pre_hook(
        *linear,
        [&stats, &recording, name = item.key()](torch::nn::Module& module, nn::TensorRefs& inputs) {
          if (!recording || inputs.empty()) return;
          auto& slot = stats[name];
          slot.first = std::max(slot.first, inputs.front()->abs().max().item<double>());
          const auto& weight = static_cast<torch::nn::LinearImpl&>(module).weight;
          slot.second = std::max(slot.second, weight.abs().max().item<double>());
        }));
  }

  // A tied head (lm_head.weight is embed_tokens.weight) is no Linear module here, but it is
  // one in transformers and is quantized like the others: its input is the final norm's output
  // and its weight the embedding's (the vocabulary rows this rank holds, under tensor
  // parallelism; the TP sync below takes the max over them).
  if (!model->lm_head) {
    stats["lm_head"] = {0.0, 0.0};
    hooks.push_back(nn::register_forward_hook(
        *model->model->norm,
        [&stats, &recording, &model](torch::nn::Module&, nn::TensorRefs& outputs) {
          if (!recording || outputs.empty()) return;
          auto& slot = stats["lm_head"];
          slot.first = std::max(slot.first, outputs.front()->abs().max().item<double>());
          slot.second =
              std::max(slot.second, model->model->embed_tokens->weight.abs().max().item<double>());
        }));
  }
  const int64_t total =
      o.max_sequences > 0 ? std::min(o.max_sequences, windows.count()) : windows.count();
  say("mdist calibrate: model " + choice.description);
  say("mdist calibrate: " + tokenizer_line(choice));
  say("mdist calibrate: " + std::to_string(total) + " sequences of " +
      std::to_string(o.io.seq_len) + " tokens from " + data.description + ", " +
      std::to_string(stats.size()) + " Linear modules, " + describe_layout(parallel));
  // One sequence per forward: a sequence's activations are then computed the same way
  // whatever the number of ranks, so the maxima (and the JSON) are identical bit for bit.
  const auto plan = plan_forwards(total, mdist::size(parallel.data_parallel_group.group()),
                                  mdist::rank(parallel.data_parallel_group.group()), 1);
  for (int64_t round = 0; round < plan.rounds; ++round) {
    const bool real = round < static_cast<int64_t>(plan.windows.size());
    recording = real;
    model->forward(
        batch_of(windows, {real ? plan.windows[static_cast<std::size_t>(round)] : 0}).to(device));
  }
  recording = false;
  for (auto& hook : hooks) hook.remove();

  // A "not used" tensor-parallel group is skipped.
  const AbsMax synced = DistributedProcessGroup::get_dist_syncd_obj(
      stats, {parallel.data_parallel_group, parallel.tensor_parallel_group}, elementwise_max);
  if (rank() == 0) {
    nlohmann::ordered_json modules = nlohmann::ordered_json::object();
    for (const auto& [name, value] : synced) {
      modules[name] = {{"input_absmax", value.first}, {"weight_absmax", value.second}};
    }
    const nlohmann::ordered_json result = {{"format", "mdist.calibration.v1"},
                                           {"statistic", "absmax"},
                                           {"model", choice.description},
                                           {"data", data.description},
                                           {"sequences", total},
                                           {"seq_len", o.io.seq_len},
                                           {"modules", modules}};
    if (o.out.has_parent_path()) std::filesystem::create_directories(o.out.parent_path());
    hf::write_file_atomically(o.out, result.dump(2) + "\n");
    say("mdist calibrate: wrote " + o.out.string());
  }
  barrier();
  return 0;
}

}  // namespace mdist::cli
