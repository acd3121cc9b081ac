// `mdist calibrate`: post-training-quantization calibration, as modelopt's max calibration
// (modelopt/torch/quantization/model_calib.py, max_calibrate).
// Forward-only passes over data split across the data-parallel group record, for every
// Linear, the absolute max of its input and of its weight; the ranks' maxima are synced with
// get_dist_syncd_obj (max) over the ParallelState's data-parallel group, then over its
// tensor-parallel group (a column-parallel layer's weight, a row-parallel layer's input and
// weight are split over it: modelopt's rule syncs both amaxes of both kinds over TP), and
// written as JSON keyed by the HF module names, whatever the layout.
//
// Mixtures of experts. Every routed expert's Linear is recorded under its global HF name
// (model.layers.L.mlp.experts.E.gate_proj), on the ranks that hold it: all data-parallel ranks
// without expert parallelism, its expert-data-parallel group with it. modelopt's rules then
// hold by construction: DP sync for everything (experts included: a max over the ranks that
// hold the same expert), EP sync for everything but routed experts' weight amax (under global
// names the EP ranks' experts are different keys, never merged into one another). The weight
// amax of every held expert is recorded, also of one no token chose, as modelopt's
// weight_only_quantize does. An expert whose input amax exists on some of its ranks but not on
// others, or on none (no calibration token reached it), makes the calibration incomplete: one
// error naming the experts ("MoE calibration incomplete", as modelopt raises), unless
// --allow-incomplete-moe, which reports them and writes the maxima of the ranks that have
// one (null where no rank has). Tokens routed to each expert are reported per layer.
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "mdist/groups/parallel_state.h"
#include "mdist/hf/safetensors.h"
#include "mdist/io/atomic_file.h"
#include "mdist/nn/hooks.h"
#include "mdist/objects/codec.h"
#include "mdist/runtime/runtime.h"
#include "mdist/train/forward_split.h"
#include "src/cli/commands.h"
#include "src/cli/job.h"

namespace mdist::cli {
namespace {

// One Linear's maxima on this rank. An input max is absent until a non-empty input reached
// the module (a routed expert no token chose); a weight max once the module's weight was seen.
struct ModuleAmax {
  std::optional<double> input;
  std::optional<double> weight;
};

}  // namespace
}  // namespace mdist::cli

template <>
struct mdist::Codec<mdist::cli::ModuleAmax> {
  static void encode(mdist::ByteWriter& out, const mdist::cli::ModuleAmax& value) {
    mdist::encode(out, value.input);
    mdist::encode(out, value.weight);
  }
  static mdist::cli::ModuleAmax decode(mdist::ByteReader& in) {
    mdist::cli::ModuleAmax value;
    value.input = mdist::decode<std::optional<double>>(in);
    value.weight = mdist::decode<std::optional<double>>(in);
    return value;
  }
};

namespace mdist::cli {
namespace {

// module name -> maxima
using AbsMax = std::map<std::string, ModuleAmax>;

void raise_to(std::optional<double>& slot, const std::optional<double>& value) {
  if (value) slot = slot ? std::max(*slot, *value) : *value;
}

AbsMax elementwise_max(const std::vector<AbsMax>& per_rank) {
  AbsMax result;
  for (const auto& stats : per_rank) {
    for (const auto& [name, value] : stats) {
      auto& slot = result[name];
      raise_to(slot.input, value.input);
      raise_to(slot.weight, value.weight);
    }
  }
  return result;
}

// A routed expert whose calibration is incomplete: the ranks holding it that saw no token.
struct IncompleteExpert {
  std::string name;                // model.layers.L.mlp.experts.E
  std::vector<int> ranks_without;  // data-parallel ranks
  std::vector<int> ranks_holding;
};

// From every data-parallel rank's maxima (index = rank in the group): the routed experts whose
// input max is missing on all the ranks that hold them, and with `partial` (expert
// parallelism on: modelopt checks only then) also those missing it on some of them.
// `experts_modules` name the Experts modules (model.layers.L.mlp.experts, the same on every
// rank; the experts under them differ by rank under expert parallelism).
std::vector<IncompleteExpert> incomplete_experts(const std::vector<AbsMax>& per_rank,
                                                 const std::set<std::string>& experts_modules,
                                                 bool partial) {
  // expert name -> (rank -> saw tokens); an expert saw tokens on a rank when any of its
  // Linears got input there (they all do together).
  std::map<std::string, std::map<int, bool>> seen;
  for (std::size_t r = 0; r < per_rank.size(); ++r) {
    for (const auto& [name, value] : per_rank[r]) {
      // name: <experts module>.<expert>.<linear>
      const std::string expert = name.substr(0, name.rfind('.'));
      if (!experts_modules.contains(expert.substr(0, expert.rfind('.')))) continue;
      bool& slot = seen[expert][static_cast<int>(r)];
      slot = slot || value.input.has_value();
    }
  }
  std::vector<IncompleteExpert> incomplete;
  for (const auto& [expert, by_rank] : seen) {
    IncompleteExpert entry{expert, {}, {}};
    for (const auto& [r, saw] : by_rank) {
      entry.ranks_holding.push_back(r);
      if (!saw) entry.ranks_without.push_back(r);
    }
    const bool none = entry.ranks_without.size() == entry.ranks_holding.size();
    if (none || (partial && !entry.ranks_without.empty())) incomplete.push_back(std::move(entry));
  }
  return incomplete;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (std::size_t i = 0; i < ranks.size(); ++i) text += (i ? "," : "") + std::to_string(ranks[i]);
  return text;
}

// "model.layers.0.mlp.experts.3 (no tokens on rank 2 of its ranks 0,2); ... and 5 more"
std::string describe(const std::vector<IncompleteExpert>& incomplete, std::size_t shown) {
  std::string text;
  for (std::size_t i = 0; i < std::min(shown, incomplete.size()); ++i) {
    const auto& e = incomplete[i];
    text += (i ? "; " : "") + e.name + " (no tokens on ";
    if (e.ranks_without.size() < e.ranks_holding.size()) {
      text += (e.ranks_without.size() == 1 ? "rank " : "ranks ") + rank_list(e.ranks_without) +
              " of its ranks " + rank_list(e.ranks_holding);
    } else if (e.ranks_holding.size() == 1) {
      text += "its rank";
    } else {
      text += "any of its ranks " + rank_list(e.ranks_holding);
    }
    text += ")";
  }
  if (incomplete.size() > shown) {
    text += " and " + std::to_string(incomplete.size() - shown) + " more";
  }
  return text;
}

nlohmann::ordered_json optional_json(const std::optional<double>& value) {
  return value ? nlohmann::ordered_json(*value) : nlohmann::ordered_json(nullptr);
}

// Records every Linear's input and weight maxima (and a mixture of experts' routing) through
// forward hooks on the model, for as long as it lives.
class AmaxRecorder {
 public:
  explicit AmaxRecorder(hf::CausalLM& model) : model_(model) {
    hook_experts();
    hook_linears();
    hook_tied_head();
  }
  ~AmaxRecorder() {
    for (auto& hook : hooks_) hook.remove();
  }
  AmaxRecorder(const AmaxRecorder&) = delete;
  AmaxRecorder& operator=(const AmaxRecorder&) = delete;

  // false during a padding forward (this rank has no sequence left while others do).
  void set_recording(bool recording) { recording_ = recording; }
  AbsMax& stats() { return stats_; }
  const std::set<std::string>& experts_modules() const { return experts_modules_; }
  std::map<std::string, std::vector<int64_t>>& expert_tokens() { return expert_tokens_; }

 private:
  // Routed experts: tokens per expert counted where they are routed (each rank its own
  // sequences: the same counts whatever the layout), and every held expert's weight maxima
  // taken once, with the experts' FSDP unit gathered (its pre-hook, registered first, has run).
  void hook_experts() {
    for (const auto& item : model_->named_modules("", /*include_self=*/false)) {
      auto* experts = dynamic_cast<hf::ExpertsImpl*>(item.value().get());
      if (experts == nullptr) continue;
      const std::string prefix = item.key();
      expert_tokens_[prefix].assign(static_cast<std::size_t>(experts->num_experts), 0);
      experts_modules_.insert(prefix);
      hooks_.push_back(nn::register_forward_pre_hook(
          *experts, [this, prefix, experts](torch::nn::Module&, nn::TensorRefs& inputs) {
            on_experts_input(prefix, *experts, inputs);
          }));
      hooks_.push_back(nn::register_forward_hook(
          *experts, [this, prefix](torch::nn::Module&, nn::TensorRefs& outputs) {
            if (recording_ || outputs.empty()) return;
            at::Tensor& out = *outputs.front();
            out = at::zeros({rows_of_dummy_.at(prefix), out.size(1)}, out.options());
          }));
    }
  }

  void on_experts_input(const std::string& prefix, hf::ExpertsImpl& experts,
                        nn::TensorRefs& inputs) {
    if (!weights_taken_.contains(prefix)) {
      weights_taken_.insert(prefix);
      for (const auto& sub : experts.named_modules("", /*include_self=*/false)) {
        const auto* linear = dynamic_cast<torch::nn::LinearImpl*>(sub.value().get());
        if (linear == nullptr) continue;
        raise_to(stats_[prefix + "." + sub.key()].weight,
                 linear->weight.abs().max().item<double>());
      }
    }
    // inputs: tokens [N, hidden], chosen and weights [N, top_k].
    if (recording_) {
      const at::Tensor counts = at::bincount(inputs[1]->flatten().cpu(), {}, experts.num_experts);
      auto& total = expert_tokens_[prefix];
      for (int64_t e = 0; e < experts.num_experts; ++e) {
        total[static_cast<std::size_t>(e)] += counts[e].item<int64_t>();
      }
      return;
    }
    // A padding forward still runs every collective, but routes no token: the experts' ranks
    // must not record the padding's tokens as calibration data. Its output is replaced by
    // zeros (the forward hook).
    rows_of_dummy_[prefix] = inputs[0]->size(0);
    for (auto* tensor : inputs) *tensor = tensor->narrow(0, 0, 0);
  }

  void hook_linears() {
    for (const auto& item : model_->named_modules("", /*include_self=*/false)) {
      auto* linear = dynamic_cast<torch::nn::LinearImpl*>(item.value().get());
      if (linear == nullptr) continue;
      stats_[item.key()] = {};
      // Rows reach a routed expert from the ranks of its expert-parallel group, also while
      // this rank runs a padding forward: they are real (a padding forward sends none), so
      // recorded.
      const std::string expert = item.key().substr(0, item.key().rfind('.'));
      const bool routed = experts_modules_.contains(expert.substr(0, expert.rfind('.')));
      // A pre-hook: the module's weight is whole here (its FSDP unit has gathered it). An
      // empty input (no token chose this expert) has no max.
      hooks_.push_back(nn::register_forward_pre_hook(
          *linear,
          [this, routed, name = item.key()](torch::nn::Module& module, nn::TensorRefs& inputs) {
            if (!(recording_ || routed) || inputs.empty() || inputs.front()->numel() == 0) return;
            auto& slot = stats_[name];
            raise_to(slot.input, inputs.front()->abs().max().item<double>());
            const auto& weight = static_cast<torch::nn::LinearImpl&>(module).weight;
            raise_to(slot.weight, weight.abs().max().item<double>());
          }));
    }
  }

  // A tied head (lm_head.weight is embed_tokens.weight) is no Linear module here, but it is
  // one in transformers and is quantized like the others: its input is the final norm's
  // output and its weight the embedding's (the vocabulary rows this rank holds, under tensor
  // parallelism; the TP sync takes the max over them).
  void hook_tied_head() {
    if (model_->lm_head) return;
    stats_["lm_head"] = {};
    hooks_.push_back(nn::register_forward_hook(
        *model_->model->norm, [this](torch::nn::Module&, nn::TensorRefs& outputs) {
          if (!recording_ || outputs.empty()) return;
          auto& slot = stats_["lm_head"];
          raise_to(slot.input, outputs.front()->abs().max().item<double>());
          raise_to(slot.weight, model_->model->embed_tokens->weight.abs().max().item<double>());
        }));
  }

  hf::CausalLM& model_;
  AbsMax stats_;
  bool recording_ = true;
  std::vector<nn::HookHandle> hooks_;
  std::set<std::string> experts_modules_;                      // the Experts modules' names
  std::map<std::string, std::vector<int64_t>> expert_tokens_;  // experts module -> per expert
  std::set<std::string> weights_taken_;
  std::map<std::string, int64_t> rows_of_dummy_;  // a padding forward's token count, per block
};

// What the checks found, agreed on by every rank.
struct CalibrateInputs {
  ModelChoice choice;
  TokenStream data;
  std::optional<MixedPrecisionPolicy> mp_policy;
};

CalibrateInputs check_inputs(const CalibrateOptions& o) {
  CalibrateInputs in;
  agree_on_inputs([&] {
    in.mp_policy = parse_param_dtype(o.io.param_dtype);
    check_at_least(o.max_sequences, 0, "--max-sequences");
    check_writable_file(o.out, "output file");
    check_tensor_parallel_size(o.io.tensor_parallel);
    check_expert_parallel_size(o.io.expert_parallel, o.io.tensor_parallel);
    in.choice = model_for_inference(o.io.model_dir, o.default_run);
    check_not_quantized(in.choice, "calibrate");
    check_tensor_parallel(o.io.tensor_parallel, in.choice.config);
    check_expert_parallel(o.io.expert_parallel, o.io.tensor_parallel, in.choice.config);
    in.data = load_checked_data(o.io, DataSplit::train, in.choice, "calibrate");
  });
  return in;
}

// The synced maxima, and the routed experts that did not get calibration tokens everywhere.
struct SyncedAmax {
  AbsMax amax;
  std::vector<IncompleteExpert> incomplete;
};

// Over data parallel (which holds the expert-parallel groups), keeping each rank's maxima for
// the completeness check, then over tensor parallel ("not used" is skipped). Routed tokens are
// summed over data parallel.
SyncedAmax sync_amax(AmaxRecorder& recorder, const JobLayout& layout) {
  const ParallelState& parallel = layout.parallel;
  SyncedAmax synced;
  const auto merge_dp = [&](const std::vector<AbsMax>& per_rank) {
    synced.incomplete =
        incomplete_experts(per_rank, recorder.experts_modules(), layout.expert_parallel() > 1);
    return elementwise_max(per_rank);
  };
  synced.amax = DistributedProcessGroup::get_dist_syncd_obj(recorder.stats(),
                                                            parallel.data_parallel_group, merge_dp);
  // A process outside any job: the data-parallel group is not initialised and the op never ran.
  if (!parallel.data_parallel_group.is_initialized()) synced.amax = merge_dp({recorder.stats()});
  synced.amax = DistributedProcessGroup::get_dist_syncd_obj(
      synced.amax, parallel.tensor_parallel_group, elementwise_max);
  for (auto& [name, counts] : recorder.expert_tokens()) {
    counts = DistributedProcessGroup::get_dist_syncd_obj(
        counts, parallel.data_parallel_group, [](const std::vector<std::vector<int64_t>>& all) {
          std::vector<int64_t> sum(all.empty() ? 0 : all.front().size(), 0);
          for (const auto& one : all) {
            for (std::size_t e = 0; e < sum.size(); ++e) sum[e] += one[e];
          }
          return sum;
        });
  }
  return synced;
}

// An incomplete MoE calibration: an agreed error, or with --allow-incomplete-moe a warning.
void check_complete(const CalibrateOptions& o, const std::vector<IncompleteExpert>& incomplete) {
  // Every rank computed the same list from the same gathered maxima.
  agree_on_inputs([&] {
    if (!incomplete.empty() && !o.allow_incomplete_moe) {
      throw InputError("MoE calibration incomplete: " + std::to_string(incomplete.size()) +
                       " expert(s) received no calibration tokens on some or all of their "
                       "ranks: " +
                       describe(incomplete, 3) +
                       "; increase the calibration data (--data, --max-sequences) or pass "
                       "--allow-incomplete-moe");
    }
  });
  if (!incomplete.empty()) {
    say("mdist calibrate: warning: MoE calibration incomplete (--allow-incomplete-moe): " +
        std::to_string(incomplete.size()) +
        " expert(s) received no tokens on some or all of their ranks: " +
        describe(incomplete, incomplete.size()) +
        "; their input_absmax is the max over the ranks that saw tokens, null where none did");
  }
}

// Rank 0: the JSON result.
void write_result(const CalibrateOptions& o, const CalibrateInputs& in, const AbsMax& amax,
                  const std::map<std::string, std::vector<int64_t>>& expert_tokens,
                  int64_t sequences) {
  nlohmann::ordered_json modules = nlohmann::ordered_json::object();
  for (const auto& [name, value] : amax) {
    modules[name] = {{"input_absmax", optional_json(value.input)},
                     {"weight_absmax", optional_json(value.weight)}};
  }
  nlohmann::ordered_json result = {{"format", "mdist.calibration.v1"},
                                   {"statistic", "absmax"},
                                   {"model", in.choice.description},
                                   {"data", in.data.description},
                                   {"sequences", sequences},
                                   {"seq_len", o.io.seq_len},
                                   {"modules", modules}};
  if (!expert_tokens.empty()) {
    nlohmann::ordered_json routed = nlohmann::ordered_json::object();
    for (const auto& [name, counts] : expert_tokens) routed[name] = counts;
    result["expert_tokens"] = routed;
  }
  if (o.out.has_parent_path()) std::filesystem::create_directories(o.out.parent_path());
  io::write_file_atomically(o.out, result.dump(2) + "\n");
  say("mdist calibrate: wrote " + o.out.string());
}

}  // namespace

int run_calibrate(const CalibrateOptions& o) {
  const Session session(setup_options(o.io.timeout_s));
  configure_threads();
  const CalibrateInputs in = check_inputs(o);
  const Windows windows(in.data, o.io.seq_len, "calibrate");
  const JobLayout layout = make_layout(o.io.tensor_parallel, o.io.expert_parallel);
  hf::CausalLM model = build_wrapped_model(in.choice, o.io.seed, layout, in.mp_policy).model;
  model->eval();
  const torch::NoGradGuard no_grad;
  const c10::Device device = compute_device();
  SyncedAmax synced;
  std::map<std::string, std::vector<int64_t>> expert_tokens;
  const int64_t total =
      o.max_sequences > 0 ? std::min(o.max_sequences, windows.count()) : windows.count();
  {
    AmaxRecorder recorder(model);
    say("mdist calibrate: model " + in.choice.description);
    if (in.mp_policy) say("mdist calibrate: " + describe_mixed_precision(*in.mp_policy, model));
    say("mdist calibrate: " + tokenizer_line(in.choice));
    say("mdist calibrate: " + std::to_string(total) + " sequences of " +
        std::to_string(o.io.seq_len) + " tokens from " + in.data.description + ", " +
        std::to_string(recorder.stats().size()) + " Linear modules, " + describe_layout(layout));
    // One sequence per forward: a sequence's activations are then computed the same way
    // whatever the number of ranks, so the maxima (and the JSON) are identical bit for bit
    // (under expert parallelism an expert's rows come from several sequences at once: equal to
    // the rounding of its matrix products).
    const Group dp = layout.parallel.data_parallel_group.group();
    const auto plan = train::plan_forwards(total, mdist::size(dp), mdist::rank(dp), 1);
    for (int64_t round = 0; round < plan.rounds; ++round) {
      const bool real = round < static_cast<int64_t>(plan.windows.size());
      recorder.set_recording(real);
      model->forward(
          batch_of(windows, {real ? plan.windows[static_cast<std::size_t>(round)] : 0}).to(device));
    }
    recorder.set_recording(false);
    synced = sync_amax(recorder, layout);
    expert_tokens = recorder.expert_tokens();
  }  // the hooks go with the recorder
  check_complete(o, synced.incomplete);
  if (rank() == 0) write_result(o, in, synced.amax, expert_tokens, total);
  barrier();
  return 0;
}

}  // namespace mdist::cli
