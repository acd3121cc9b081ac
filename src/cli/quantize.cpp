// `mdist quantize`: post-training quantization of a Hugging Face checkpoint as modelopt 0.47's
// hf_ptq does it (mtq.quantize with a preset, then export_hf_checkpoint), on the library's
// mdist::quant: the model is loaded FSDP2-wrapped (and split with --tp) as `calibrate` loads
// it, calibrated with max calibration on sequences split across the data-parallel ranks
// (quant::quantize syncs the amaxes over data and tensor parallel), its held-out loss measured
// before and after (the fake-quantized model), and the unified HF checkpoint written with
// quant::export_hf_checkpoint, with the tokenizer files and a quantize.json report.
//
// Output. Every file is first written into a staging directory beside --out (each file
// atomically, rank 0), then renamed into --out: a new --out appears whole; an existing one
// keeps its other files and gets each of the export's files replaced whole. Bad input is
// agreed on before anything is created.
//
// int8_sq (INT8_SMOOTHQUANT_CFG) calibrates with SmoothQuant (alpha 1.0) instead of max;
// nvfp4 (NVFP4_DEFAULT_CFG), int4_awq (INT4_AWQ_CFG) and w4a8_awq (W4A8_AWQ_BETA_CFG) need
// every quantized Linear's in_features to be a multiple of their blocks (16, 128; checked
// before loading). int4_awq and w4a8_awq calibrate with AWQ-lite (two passes over the
// calibration data, then on the FSDP2-wrapped model one forward per rank, in which the folded
// weights' block amax is taken; SmoothQuant's second pass is that one forward per rank too).
// --kv-cache fp8 adds modelopt's FP8_KV_CFG (quant::add_kv_cache_rules) to any format. --ep E
// splits a mixture of experts' routed experts over expert-parallel groups as `calibrate --ep`
// does (each expert's weight amax synced over the ranks holding it, a block's shared expert
// input amax over data parallel, the export gathering them to rank 0); with fp8, int8, nvfp4
// and int8_sq (whose experts are not smoothed, as modelopt's fused experts; AWQ refuses a
// mixture of experts). Not implemented yet (refused with one line, exit 2): --ep with --tp,
// --param-dtype.
//
// Progress: on a terminal rank 0 redraws one line per phase in place (held-out loss before,
// calibrating, SmoothQuant's smoothing pass, held-out loss after, exporting) with a count of
// sequences and the elapsed time; elsewhere nothing more than the lines above is printed.
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "mdist/io/atomic_file.h"
#include "mdist/nn/hooks.h"
#include "mdist/objects/collectives.h"
#include "mdist/quant/block_check.h"
#include "mdist/quant/export.h"
#include "mdist/quant/quantize.h"
#include "mdist/runtime/runtime.h"
#include "mdist/train/evaluate.h"
#include "mdist/train/forward_split.h"
#include "src/cli/commands.h"
#include "src/cli/export_dir.h"
#include "src/cli/job.h"
#include "src/cli/phase_progress.h"
#include "src/cli/quantize_from_run.h"

namespace mdist::cli {
namespace {

using json = nlohmann::ordered_json;
using Seconds = std::chrono::duration<double>;

// --format: the presets quant::QuantConfig knows, with the quant_algo their export writes.
const std::map<std::string, std::string>& implemented_formats() {
  static const std::map<std::string, std::string> formats = {{"fp8", "FP8"},
                                                             {"int8", "W8A8_SQ_PER_CHANNEL"},
                                                             {"int8_sq", "W8A8_SQ_PER_CHANNEL"},
                                                             {"int4_awq", "W4A16_AWQ"},
                                                             {"w4a8_awq", "W4A8_AWQ"},
                                                             {"nvfp4", "NVFP4"}};
  return formats;
}

void check_format(const QuantizeOptions& o) {
  if (o.format.empty()) {
    throw InputError(
        "--format is required: fp8, int8, int8_sq, int4_awq, w4a8_awq or nvfp4 (modelopt's "
        "FP8_DEFAULT_CFG, INT8_DEFAULT_CFG, INT8_SMOOTHQUANT_CFG, INT4_AWQ_CFG, "
        "W4A8_AWQ_BETA_CFG, NVFP4_DEFAULT_CFG)");
  }
  if (!implemented_formats().contains(o.format)) {
    throw InputError("unknown --format '" + o.format +
                     "'; the formats are fp8, int8, int8_sq, int4_awq, w4a8_awq and nvfp4");
  }
  if (o.sq_alpha && o.format != "int8_sq") {
    throw InputError("--sq-alpha is SmoothQuant's alpha: it needs --format int8_sq, not " +
                     o.format);
  }
  if (o.sq_alpha && !(*o.sq_alpha >= 0.0 && *o.sq_alpha <= 1.0)) {
    throw InputError("--sq-alpha " + flag_value(*o.sq_alpha) +
                     " is outside [0, 1] (modelopt's SmoothQuantCalibConfig.alpha)");
  }
  if (!o.kv_cache.empty() && o.kv_cache != "fp8") {
    throw InputError("unknown --kv-cache '" + o.kv_cache +
                     "'; the KV-cache format is fp8 (modelopt's FP8_KV_CFG)");
  }
}

// --out: required; see check_export_dir.
void check_out(const QuantizeOptions& o) {
  if (!o.out) throw InputError("--out DIR is required: the directory the export is written to");
  check_export_dir(*o.out, "--out");
}

// What the checks found, agreed on by every rank.
struct QuantizeInputs {
  ModelChoice choice;
  TokenStream calib;
  TokenStream eval;
};

QuantizeInputs check_inputs(const QuantizeOptions& o) {
  QuantizeInputs in;
  agree_on_inputs([&] {
    check_format(o);
    check_out(o);
    check_at_least(o.calib_sequences, 0, "--calib-sequences");
    check_at_least(o.eval_sequences, 0, "--eval-sequences");
    check_at_least(o.batch_size, 1, "--batch-size");
    if (!o.io.param_dtype.empty()) {
      throw InputError(
          "--param-dtype is not supported by quantize: the model is calibrated and exported in "
          "its weights' dtype");
    }
    check_tensor_parallel_size(o.io.tensor_parallel);
    check_expert_parallel_size(o.io.expert_parallel, o.io.tensor_parallel);
    if (o.io.expert_parallel > 1 && o.io.tensor_parallel > 1) {
      // mdist::quant refuses it too: the export's gathers of experts and of tensor-parallel
      // shards are not combined yet.
      throw InputError("--ep " + std::to_string(o.io.expert_parallel) + " with --tp " +
                       std::to_string(o.io.tensor_parallel) +
                       ": quantize does not support expert and tensor parallelism together yet");
    }
    // Before the model's own checks: a quantized checkpoint is named as such, whatever its
    // quant_algo (the loader reads only some).
    if (o.io.model_dir) {
      try {
        if (const auto q = hf::checkpoint_quantization(*o.io.model_dir)) {
          throw InputError("model directory '" + o.io.model_dir->string() +
                           "' is already quantized (quant_algo " + q->quant_algo + " in " +
                           q->source + "); quantize needs an unquantized checkpoint");
        }
      } catch (const InputError&) {
        throw;
      } catch (const Error& error) {
        throw InputError("model directory '" + o.io.model_dir->string() + "': " + error.what());
      }
    }
    in.choice = model_for_inference(o.io.model_dir, o.default_run);
    check_not_quantized(in.choice, "quantize");
    check_tensor_parallel(o.io.tensor_parallel, in.choice.config);
    check_expert_parallel(o.io.expert_parallel, o.io.tensor_parallel, in.choice.config);
    if (!o.kv_cache.empty() && in.choice.config.fused_projections) {
      // mdist::quant refuses it too (kv_cache.h).
      throw InputError("--kv-cache " + o.kv_cache +
                       " is not supported for this model: its attention has one fused qkv_proj "
                       "(Phi-3), and the unified checkpoint names k_scale / v_scale after k_proj "
                       "/ v_proj");
    }
    if ((o.format == "int4_awq" || o.format == "w4a8_awq") && in.choice.config.moe) {
      throw InputError(
          "--format " + o.format +
          " is not supported for a mixture of experts yet (modelopt quantizes "
          "its fused experts in a way mdist's per-expert layers do not reproduce); use --format "
          "int8 or fp8");
    }
    {
      // Block formats (int4_awq, w4a8_awq, nvfp4) need whole blocks along every quantized Linear's
      // inputs: checked on the model's shapes alone (the meta device), before anything is
      // loaded.
      hf::CausalLM shapes(in.choice.config, c10::kMeta);
      if (const auto problem =
              quant::block_size_problem(shapes, quant::QuantConfig::preset(o.format),
                                        static_cast<int>(o.io.tensor_parallel))) {
        throw InputError("--format " + o.format + ": " + *problem);
      }
    }
    in.calib = load_checked_data(o.io, DataSplit::train, in.choice, "quantize: calibration");
    // The held-out data as `mdist eval` reads it with the same flags: the embedded corpus's
    // eval split, or all of the file.
    ModelDataOptions held_out = o.io;
    if (o.eval_data) held_out.data = o.eval_data;
    held_out.split = "auto";
    in.eval = load_checked_data(held_out, DataSplit::eval, in.choice, "quantize: held-out");
  });
  return in;
}

// Tokens each routed expert received on this rank, counted where they are routed (the
// Experts module's pre-hook), for as long as the counter lives.
class ExpertTokens {
 public:
  explicit ExpertTokens(hf::CausalLM& model) {
    for (const auto& item : model->named_modules("", /*include_self=*/false)) {
      auto* experts = dynamic_cast<hf::ExpertsImpl*>(item.value().get());
      if (experts == nullptr) continue;
      auto& counts = counts_[item.key()];
      counts.assign(static_cast<std::size_t>(experts->num_experts), 0);
      hooks_.push_back(nn::register_forward_pre_hook(
          *experts, [&counts, experts](torch::nn::Module&, nn::TensorRefs& inputs) {
            const at::Tensor n = at::bincount(inputs[1]->flatten().cpu(), {}, experts->num_experts);
            for (int64_t e = 0; e < experts->num_experts; ++e) {
              counts[static_cast<std::size_t>(e)] += n[e].item<int64_t>();
            }
          }));
    }
  }
  ~ExpertTokens() {
    for (auto& hook : hooks_) hook.remove();
  }
  ExpertTokens(const ExpertTokens&) = delete;
  ExpertTokens& operator=(const ExpertTokens&) = delete;

  // experts module -> tokens per expert, on this rank.
  const std::map<std::string, std::vector<int64_t>>& counts() const { return counts_; }

 private:
  std::map<std::string, std::vector<int64_t>> counts_;
  std::vector<nn::HookHandle> hooks_;
};

// The routed experts some rank holding them ran on no calibration token ("MoE calibration
// incomplete", as modelopt raises and `mdist calibrate` reports): an agreed InputError.
// Stricter than modelopt on several ranks: FSDP2 gathers an expert's weight only inside its
// forward, so its weight amax is taken there, on every rank that holds it; an expert a rank
// never ran has no weight amax on that rank (quant::quantize refuses it), so it is refused here
// first, by every rank alike. Without expert parallelism a rank runs every expert on its own
// tokens; with it, the rank holding global expert E runs it on the tokens its expert-parallel
// group (a consecutive chunk of the data-parallel ranks) routed to E: their counts are summed.
void check_experts_reached(const ExpertTokens& tokens, const JobLayout& layout) {
  const DistributedProcessGroup& dp = layout.parallel.data_parallel_group;
  const auto per_rank =
      dp.is_initialized() ? allgather(tokens.counts(), dp.group()) : std::vector{tokens.counts()};
  const auto ep = static_cast<std::size_t>(layout.expert_parallel());
  agree_on_inputs([&] {
    std::vector<std::string> missing;
    const std::size_t groups = per_rank.size() / ep;
    for (const auto& [module, counts] : tokens.counts()) {
      for (std::size_t e = 0; e < counts.size(); ++e) {
        std::vector<int> without;  // groups (one rank each without expert parallelism)
        for (std::size_t g = 0; g < groups; ++g) {
          int64_t reached = 0;
          for (std::size_t r = g * ep; r < (g + 1) * ep; ++r) reached += per_rank[r].at(module)[e];
          if (reached == 0) without.push_back(static_cast<int>(g));
        }
        if (without.empty()) continue;
        std::string where;
        for (const int g : without) {
          where += where.empty() ? "" : ",";
          where += ep == 1 ? std::to_string(g)
                           : std::to_string(g * ep) + "-" + std::to_string((g + 1) * ep - 1);
        }
        missing.push_back(module + "." + std::to_string(e) +
                          (without.size() == groups ? " (no tokens on any rank)"
                           : ep == 1
                               ? " (no tokens on rank(s) " + where + ")"
                               : " (no tokens from the expert-parallel group(s) of data-parallel "
                                 "ranks " +
                                     where + ")"));
      }
    }
    if (missing.empty()) return;
    std::string shown;
    for (std::size_t i = 0; i < std::min<std::size_t>(3, missing.size()); ++i) {
      shown += (i ? "; " : "") + missing[i];
    }
    if (missing.size() > 3) shown += " and " + std::to_string(missing.size() - 3) + " more";
    throw InputError("MoE calibration incomplete: " + std::to_string(missing.size()) +
                     " expert(s) received no calibration tokens on some or all data-parallel "
                     "ranks: " +
                     shown + "; increase the calibration data (--data, --calib-sequences)");
  });
}

// Counts the sequences the model's forwards run (its first input's batch dimension) on this
// rank, for as long as it lives, and shows them in `progress` as the whole data-parallel
// group's: the ranks run their forwards in step (FSDP2's collectives), so rank 0's count times
// the group's size is what the group has done (capped at the phase's total by the line).
class ForwardCounter {
 public:
  ForwardCounter(hf::CausalLM& model, PhaseProgress& progress, int64_t data_parallel)
      : hook_(nn::register_forward_pre_hook(
            *model, [this, &progress, data_parallel](torch::nn::Module&, nn::TensorRefs& inputs) {
              sequences_ += inputs[0]->size(0);
              progress.update(sequences_ * data_parallel);
            })) {}
  ~ForwardCounter() { hook_.remove(); }
  ForwardCounter(const ForwardCounter&) = delete;
  ForwardCounter& operator=(const ForwardCounter&) = delete;
  // A new phase counts from 0.
  void reset() { sequences_ = 0; }

 private:
  int64_t sequences_ = 0;
  nn::HookHandle hook_;
};

double held_out(hf::CausalLM& model, const hf::ParallelModel& built, const Windows& windows,
                const TokenStream& data, const QuantizeOptions& o, const JobLayout& layout,
                int64_t& tokens) {
  const train::HeldOutLoss loss =
      train::held_out_loss(model, built.parallelism, sequence_source(windows, data.description),
                           layout.parallel, o.batch_size, o.eval_sequences);
  tokens = loss.tokens;
  return loss.mean();
}

json amax_json(const at::Tensor& amax) {
  const at::Tensor values = amax.detach().to(at::kCPU, at::kDouble).contiguous();
  if (values.numel() == 1) return values.item<double>();
  return std::vector<double>(values.data_ptr<double>(), values.data_ptr<double>() + values.numel());
}

// module -> {"input_amax", "weight_amax"} (a number, or one per output row or block; W4A8's
// second weight stage: "weight_amax_2").
json modules_json(const std::map<std::string, at::Tensor>& amax) {
  json modules = json::object();
  for (const auto& [key, value] : amax) {
    // key: <module>.<input|weight>_quantizer._amax, or a SequentialQuantizer's stage
    // <module>.weight_quantizer.<0|1>._amax.
    const std::string quantizer = key.substr(0, key.size() - std::string("._amax").size());
    const bool stage_2 = quantizer.ends_with(".weight_quantizer.1");
    const std::string base = stage_2 || quantizer.ends_with(".weight_quantizer.0")
                                 ? quantizer.substr(0, quantizer.size() - 2)
                                 : quantizer;
    const std::string module = base.substr(0, base.rfind('.'));
    const std::string role = base.ends_with(".input_quantizer")   ? "input_amax"
                             : base.ends_with(".k_bmm_quantizer") ? "k_amax"
                             : base.ends_with(".v_bmm_quantizer") ? "v_amax"
                             : stage_2                            ? "weight_amax_2"
                                                                  : "weight_amax";
    modules[module][role] = amax_json(value);
  }
  return modules;
}

}  // namespace

int run_quantize(const QuantizeOptions& o) {
  if (o.from_run) return run_quantize_from_run(o);
  const Session session(setup_options(o.io.timeout_s));
  configure_threads();
  const QuantizeInputs in = check_inputs(o);
  const Windows calib_windows(in.calib, o.io.seq_len, "quantize: calibration");
  const Windows eval_windows(in.eval, o.io.seq_len, "quantize: held-out");
  const JobLayout layout = make_layout(o.io.tensor_parallel, o.io.expert_parallel);
  const auto start = std::chrono::steady_clock::now();
  auto lap = start;
  const auto seconds_since = [](auto& since) {
    const auto now = std::chrono::steady_clock::now();
    const double s = Seconds(now - since).count();
    since = now;
    return s;
  };
  const hf::ParallelModel built = build_wrapped_model(in.choice, o.io.seed, layout);
  hf::CausalLM model = built.model;
  model->eval();
  const torch::NoGradGuard no_grad;
  const c10::Device device = compute_device();
  const double load_s = seconds_since(lap);
  const int64_t calib_total = o.calib_sequences > 0
                                  ? std::min(o.calib_sequences, calib_windows.count())
                                  : calib_windows.count();
  quant::QuantConfig config = quant::QuantConfig::preset(o.format);
  if (o.sq_alpha) config.smoothquant_alpha = *o.sq_alpha;
  if (!o.kv_cache.empty()) quant::add_kv_cache_rules(config, o.kv_cache);
  say("mdist quantize: model " + in.choice.description);
  say("mdist quantize: " + tokenizer_line(in.choice));
  say("mdist quantize: format " + o.format + " (quant_algo " + implemented_formats().at(o.format) +
      "), " +
      (config.algorithm == "smoothquant"
           ? "SmoothQuant (alpha " + flag_value(config.smoothquant_alpha) + ")"
           : std::string(config.algorithm == "awq_lite" ? "AWQ-lite" : "max")) +
      (o.kv_cache.empty() ? std::string() : ", KV cache " + o.kv_cache) + " calibration on " +
      std::to_string(calib_total) + " sequences of " + std::to_string(o.io.seq_len) +
      " tokens from " + in.calib.description + ", " + describe_layout(layout));

  PhaseProgress progress(stdout, "mdist quantize", rank() == 0 && terminal_stdout());
  const int64_t data_parallel = mdist::size() / layout.tensor_parallel();
  // held_out_loss's --eval-sequences: 0 is every window.
  const int64_t eval_total = o.eval_sequences > 0 ? std::min(o.eval_sequences, eval_windows.count())
                                                  : eval_windows.count();
  ForwardCounter counter(model, progress, data_parallel);
  const auto phase = [&](const std::string& name, int64_t total) {
    counter.reset();
    progress.begin(name, total, total > 0 ? "sequences" : "");
  };

  int64_t eval_tokens = 0;
  phase("held-out loss before quantization", eval_total);
  const double loss_before = held_out(model, built, eval_windows, in.eval, o, layout, eval_tokens);
  const double eval_before_s = seconds_since(lap);
  progress.finish();
  char line[256];
  std::snprintf(line, sizeof(line),
                "mdist quantize: held-out loss before quantization %.6f nats/token (%lld tokens "
                "of %s)",
                loss_before, static_cast<long long>(eval_tokens), in.eval.description.c_str());
  say(line);

  std::unique_ptr<quant::ModelQuantizers> quantizers;
  {
    ExpertTokens expert_tokens(model);
    // One sequence per forward, as `calibrate`: a sequence's activations are computed the same
    // way whatever the number of ranks, so the amaxes (and the export) are equal bit for bit
    // across data-parallel layouts. A rank with no sequence left runs the first one again so
    // that every rank runs the same forwards (FSDP2's collectives): max calibration over the
    // data-parallel group already includes that sequence, so the synced amax is unchanged.
    int passes = 0;
    const quant::ForwardLoop loop = [&](hf::CausalLM& m) {
      // SmoothQuant runs the loop a second time, over the smoothed weights; AWQ-lite a second
      // time for its search (and a third on the FSDP2 model, for the folded weights' amax).
      const bool awq = config.algorithm == "awq_lite";
      // SmoothQuant's second pass and AWQ's third only take each folded weight's amax, in that
      // Linear's first forward (quant::quantize throws if one did not run), and every such
      // Linear runs in every forward (SmoothQuant leaves routed experts alone, AWQ refuses a
      // mixture of experts): one forward per rank does it. The rest of the pass would repeat
      // fake-quantized forwards that change no state.
      const bool weight_amax_pass = passes == (awq ? 2 : 1);
      phase(passes == 0   ? "calibrating"
            : !awq        ? "smoothing pass"
            : passes == 1 ? "AWQ search pass"
                          : "AWQ weight amax pass",
            weight_amax_pass ? data_parallel : calib_total);
      ++passes;
      const Group dp = layout.parallel.data_parallel_group.group();
      const auto plan = train::plan_forwards(calib_total, mdist::size(dp), mdist::rank(dp), 1);
      const int64_t rounds = weight_amax_pass ? std::min<int64_t>(plan.rounds, 1) : plan.rounds;
      for (int64_t round = 0; round < rounds; ++round) {
        const bool real = round < static_cast<int64_t>(plan.windows.size());
        // A repeat of the first sequence counts in no mean (AWQ's statistics).
        std::optional<quant::UncountedForward> uncounted;
        if (!real) uncounted.emplace();
        m->forward(
            batch_of(calib_windows, {real ? plan.windows[static_cast<std::size_t>(round)] : 0})
                .to(device));
      }
      check_experts_reached(expert_tokens, layout);
    };
    quantizers = quant::quantize(model, config, loop,
                                 {.parallel = layout.parallel,
                                  .parallelism = built.parallelism,
                                  .expert_data_parallel = layout.expert_data_parallel});
  }
  const double calibrate_s = seconds_since(lap);
  phase("held-out loss after quantization", eval_total);
  const double loss_after = held_out(model, built, eval_windows, in.eval, o, layout, eval_tokens);
  const double eval_after_s = seconds_since(lap);
  progress.finish();
  std::snprintf(line, sizeof(line),
                "mdist quantize: held-out loss after quantization %.6f nats/token (fake-quantized "
                "%s; %+.6f)",
                loss_after, o.format.c_str(), loss_after - loss_before);
  say(line);

  phase("exporting", 0);
  const auto amax = quant::whole_amax_state_dict(*quantizers, built.parallelism);
  const std::filesystem::path staging = staging_dir(*o.out);
  if (rank() == 0) std::filesystem::remove_all(staging);
  barrier();
  quant::export_hf_checkpoint(model, *quantizers, staging, built.parallelism);
  const double export_s = seconds_since(lap);
  if (rank() == 0) {
    copy_into(tokenizer_files(in.choice), staging);
    const int tp = layout.tensor_parallel();
    const json report = {
        {"format", "mdist.quantize.v1"},
        {"quant_format", o.format},
        {"quant_algo", implemented_formats().at(o.format)},
        {"kv_cache_quant_algo", o.kv_cache.empty() ? json(nullptr) : json("FP8")},
        {"calibration", config.algorithm},
        {"smoothquant_alpha",
         config.algorithm == "smoothquant" ? json(config.smoothquant_alpha) : json(nullptr)},
        {"model", in.choice.description},
        {"calibration_data", in.calib.description},
        {"calibration_sequences", calib_total},
        {"seq_len", o.io.seq_len},
        {"held_out_data", in.eval.description},
        {"held_out_tokens", eval_tokens},
        {"loss_before", loss_before},
        {"loss_after", loss_after},
        {"layout",
         {{"world", mdist::size()},
          {"data_parallel", mdist::size() / tp},
          {"tensor_parallel", tp},
          {"expert_parallel", layout.expert_parallel()},
          {"description", describe_layout(layout)}}},
        {"seconds",
         {{"load", load_s},
          {"held_out_before", eval_before_s},
          {"calibrate", calibrate_s},
          {"held_out_after", eval_after_s},
          {"export", export_s},
          {"total", Seconds(std::chrono::steady_clock::now() - start).count()}}},
        {"modules", modules_json(amax)}};
    io::write_file_atomically(staging / "quantize.json", report.dump(2) + "\n");
    publish(staging, *o.out);
    progress.finish();
    say("mdist quantize: wrote " + o.out->string() + " (unified HF checkpoint, quantize.json)");
  }
  barrier();
  return 0;
}

}  // namespace mdist::cli
