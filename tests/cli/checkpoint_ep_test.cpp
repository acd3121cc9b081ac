// The training library's checkpoints (mdist/train/checkpoint.h, as `mdist train` writes
// them) under expert parallelism, run by mdistrun with 1-4 ranks: a checkpoint written in any (dp,
// ep) layout, with the experts sharded by FSDP or whole, holds every expert's AdamW moments once
// under its global name, and resumes in every other layout the world allows as the unsplit model's
// run would continue.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/expert_parallel.h"
#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/hf/pretrained.h"
#include "mdist/mdist.h"
#include "mdist/runtime/c10d.h"
#include "mdist/train/checkpoint.h"

namespace {

using mdist::hf::CausalLM;
using mdist::hf::LlamaConfig;

constexpr int kSavedSteps = 3, kResumedSteps = 2, kGlobalBatch = 12, kSeqLen = 8;
constexpr double kLr = 1e-2;
// Relative to the largest magnitude of the tensor (moments, weights) or to the loss. A moment
// resumed from another expert's state or from none is off by about its own size, and the
// weights it updates by about the learning rate's steps (~1e-1 relative). The data-parallel
// run sums its gradients in another order than one process (FSDP's reduce-scatter, the
// experts' all-to-all): Mixtral's experts that few tokens reach then differ by up to ~5e-5 in
// their moments and, after AdamW's normalised updates, ~1.3e-4 in their weights (measured on
// 3 and 4 ranks; as much with ep 1, i.e. without expert parallelism).
constexpr double kMomentTolerance = 5e-4, kLossTolerance = 1e-5, kWeightTolerance = 1e-3;

LlamaConfig fixture_config(const std::string& arch) {
  LlamaConfig config =
      LlamaConfig::from_file(std::string(MDIST_HF_MODEL_FIXTURES) + "/" + arch + "/config.json");
  config.moe->num_experts = 12;  // divides over 1, 2, 3 and 4 ranks
  return config;
}

CausalLM seeded(const LlamaConfig& config) {
  torch::manual_seed(17);
  return CausalLM(config);
}

torch::optim::AdamW adamw(CausalLM& model) {
  return torch::optim::AdamW(model->parameters(),
                             torch::optim::AdamWOptions(kLr).weight_decay(0.1));
}

// The expert-parallel sizes this world allows for 12 experts.
std::vector<int> layouts() {
  std::vector<int> eps;
  for (int ep = 1; ep <= mdist::size(); ++ep) {
    if (mdist::size() % ep == 0 && 12 % ep == 0) eps.push_back(ep);
  }
  return eps;
}

struct Layout {
  mdist::ParallelState state;
  mdist::Group expert_data_parallel;
};
Layout layout_of(int ep) {
  return {mdist::make_parallel_state({.expert_model_parallel = ep}),
          mdist::make_expert_data_parallel_group({.expert_model_parallel = ep})};
}

// The sum of `tensor` over `group`, in place.
void sum_over(at::Tensor tensor, const mdist::Group& group) {
  std::vector<at::Tensor> tensors = {tensor};
  mdist::wait(mdist::process_group(group)->allreduce(tensors), group, "test allreduce");
}

// What FSDP does to the gradients of a wrapped model, for one that is not: every gradient
// summed over the ranks holding the parameter (the world, or for a split expert its
// expert-data-parallel group) and divided by the world size, the global batch's mean.
void reduce_gradients(CausalLM& model, const mdist::Group& expert_data_parallel) {
  std::set<std::string> experts;
  for (const auto& [prefix, module] : mdist::hf::named_experts(model)) {
    if (static_cast<int64_t>(module->local.size()) == module->num_experts) continue;
    for (const auto& param : module->named_parameters()) experts.insert(prefix + "." + param.key());
  }
  for (const auto& item : model->named_parameters()) {
    // An expert no local token chose has no gradient here but may have one elsewhere: every
    // rank takes part in every sum.
    if (!item.value().grad().defined()) item.value().mutable_grad() = at::zeros_like(item.value());
    at::Tensor grad = item.value().mutable_grad();
    sum_over(grad, experts.contains(item.key()) ? expert_data_parallel : mdist::Group::world());
    grad.div_(mdist::size());
  }
}

// One AdamW step of `model` on this rank's share of the global batch (the gradients reduced
// here when `unwrapped`); the global mean loss.
double train_step(CausalLM& model, torch::optim::Optimizer& optimizer, const at::Tensor& batch,
                  const std::optional<mdist::Group>& unwrapped = std::nullopt) {
  const int64_t per_rank = kGlobalBatch / mdist::size();
  const at::Tensor local = batch.narrow(0, mdist::rank() * per_rank, per_rank);
  const at::Tensor loss = mdist::hf::causal_lm_loss(model->forward(local), local);
  optimizer.zero_grad();
  loss.backward();
  if (unwrapped) reduce_gradients(model, *unwrapped);
  optimizer.step();
  return mdist::allreduce(loss.item<double>()) / mdist::size();
}

const torch::optim::AdamWParamState& state_of(torch::optim::Optimizer& optimizer,
                                              const at::Tensor& param) {
  return dynamic_cast<const torch::optim::AdamWParamState&>(
      *optimizer.state().at(param.unsafeGetTensorImpl()));
}

double relative(const at::Tensor& got, const at::Tensor& want) {
  return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item<double>();
}

class ExpertParallelCheckpoint : public ::testing::TestWithParam<std::string> {};

TEST_P(ExpertParallelCheckpoint, ResumesInEveryLayoutAsTheUnsplitRun) {
  const LlamaConfig config = fixture_config(GetParam());
  torch::manual_seed(21);
  std::vector<at::Tensor> batches;
  for (int step = 0; step < kSavedSteps + kResumedSteps; ++step) {
    batches.push_back(torch::randint(0, config.vocab_size, {kGlobalBatch, kSeqLen}));
  }
  // The unsplit run, whole batches, in every process: its losses, its moments at the
  // checkpoint, its final weights.
  CausalLM reference = seeded(config);
  auto ref_opt = adamw(reference);
  std::vector<double> ref_losses;
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> ref_moments;  // at the checkpoint
  for (int step = 0; step < kSavedSteps + kResumedSteps; ++step) {
    if (step == kSavedSteps) {
      for (const auto& item : reference->named_parameters()) {
        const auto& s = state_of(ref_opt, item.value());
        ref_moments[item.key()] = {s.exp_avg().clone(), s.exp_avg_sq().clone()};
      }
    }
    const at::Tensor& batch = batches[static_cast<std::size_t>(step)];
    const at::Tensor loss = mdist::hf::causal_lm_loss(reference->forward(batch), batch);
    ref_opt.zero_grad();
    loss.backward();
    ref_opt.step();
    ref_losses.push_back(loss.item<double>());
  }
  const auto ref_params = reference->named_parameters();
  double worst_moment = 0, worst_loss = 0, worst_weight = 0;

  const std::filesystem::path base =
      mdist::broadcast((std::filesystem::temp_directory_path() /
                        ("mdist-ep-checkpoint-" + std::to_string(::getpid()) + "-" + GetParam()))
                           .string());
  for (const int saved_ep : layouts()) {
    for (const bool wrap : {false, true}) {
      const std::string saved_as =
          "saved with ep " + std::to_string(saved_ep) + (wrap ? " and FSDP" : " unwrapped");
      const std::filesystem::path run =
          base / ("ep" + std::to_string(saved_ep) + (wrap ? "-fsdp" : ""));
      {
        CausalLM model = seeded(config);
        const Layout layout = layout_of(saved_ep);
        const mdist::hf::Parallelism parallelism{
            .expert_parallel = mdist::hf::parallelize_experts(
                model, layout.state.expert_model_parallel_group.group())};
        if (wrap) {
          mdist::hf::shard_experts(model, layout.expert_data_parallel, mdist::size());
          mdist::fsdp2_wrap(*model);
        }
        auto opt = adamw(model);
        for (int step = 0; step < kSavedSteps; ++step) {
          train_step(model, opt, batches[static_cast<std::size_t>(step)],
                     wrap ? std::nullopt : std::optional(layout.expert_data_parallel));
        }
        mdist::train::TrainerState state;
        state.step = kSavedSteps;
        state.sequences_seen = int64_t{kSavedSteps} * kGlobalBatch;
        state.run = nlohmann::json::object();
        mdist::train::save_training_checkpoint(run, model, parallelism, opt, state, 1,
                                               layout.state);
      }
      const auto checkpoint = mdist::train::latest_checkpoint(run);
      ASSERT_TRUE(checkpoint.has_value()) << saved_as;
      // Every expert's moments are there, covering each parameter exactly once.
      EXPECT_NO_THROW(mdist::train::check_optimizer_state(*checkpoint, config, kSavedSteps))
          << saved_as;
      const mdist::train::TrainerState state = mdist::train::read_trainer_state(*checkpoint);

      for (const int ep : layouts()) {
        const std::string what = saved_as + ", resumed with ep " + std::to_string(ep);
        const Layout layout = layout_of(ep);
        auto [model, parallelism] = mdist::hf::load_pretrained_fsdp2(
            *checkpoint,
            {.parallel = layout.state, .expert_data_parallel = layout.expert_data_parallel});
        auto opt = adamw(model);
        mdist::train::load_training_checkpoint(*checkpoint, model, parallelism, opt, state,
                                               layout.state);
        // Each rank's rows of its own parameters (its experts only) are the unsplit run's
        // moments at the checkpoint.
        for (const auto& [name, place] : mdist::param_placements(*model)) {
          if (place.rows == 0) continue;
          const auto& [want_avg, want_sq] = ref_moments.at(name);
          const auto& s = state_of(opt, place.param);
          const auto rows = [&](const at::Tensor& t, int64_t first) {
            return t.dim() == 0 ? t : t.narrow(0, first, place.rows);
          };
          const double avg = relative(rows(s.exp_avg(), 0), rows(want_avg, place.row_offset));
          const double sq = relative(rows(s.exp_avg_sq(), 0), rows(want_sq, place.row_offset));
          EXPECT_LT(avg, kMomentTolerance) << what << ": exp_avg of " << name;
          EXPECT_LT(sq, kMomentTolerance) << what << ": exp_avg_sq of " << name;
          worst_moment = std::max({worst_moment, avg, sq});
        }
        for (int step = kSavedSteps; step < kSavedSteps + kResumedSteps; ++step) {
          const double loss = train_step(model, opt, batches[static_cast<std::size_t>(step)]);
          const double want = ref_losses[static_cast<std::size_t>(step)];
          EXPECT_NEAR(loss, want, kLossTolerance * want) << what << ", step " << step;
          worst_loss = std::max(worst_loss, std::abs(loss - want) / want);
        }
        // The final weights, every expert among them, are the unsplit run's.
        const auto final_params = mdist::full_state_dict(*model, {.keep = true});
        for (const auto& [name, value] : final_params) {
          // k_proj's bias gets a gradient of exactly zero in exact arithmetic (it shifts every
          // score of a query by the same amount), so its float gradient is rounding noise
          // that AdamW turns into steps of about the learning rate, as in every run.
          if (name.ends_with("k_proj.bias")) continue;
          const double diff = relative(value, ref_params[name].detach());
          EXPECT_LT(diff, kWeightTolerance) << what << ": " << name;
          worst_weight = std::max(worst_weight, diff);
        }
      }
    }
  }
  worst_moment = mdist::allreduce(worst_moment, "max");
  worst_weight = mdist::allreduce(worst_weight, "max");
  if (mdist::is_master()) {
    std::cout << GetParam() << ": largest relative differences from the unsplit run: moments "
              << worst_moment << ", resumed losses " << worst_loss << ", final weights "
              << worst_weight << std::endl;
  }
  mdist::barrier();
  if (mdist::is_master()) std::filesystem::remove_all(base);
}

// Each parameter's AdamW step is its own, as in torch's optimizer.state_dict(): a parameter
// that got no gradient in one step (frozen for it, an expert no token chose) is at step 2
// while the trainer is at step 3, and one that never got a gradient has no state. Saved and
// loaded, unwrapped and FSDP-sharded: still 2, still no state, the same moments.
TEST(TrainingCheckpoint, KeepsEachParametersStepAndParametersWithoutState) {
  const LlamaConfig config =
      LlamaConfig::from_file(std::string(MDIST_HF_MODEL_FIXTURES) + "/llama/config.json");
  const std::string missed = "model.layers.0.mlp.up_proj.weight", never = "model.norm.weight";
  torch::manual_seed(5);
  const at::Tensor batch = torch::randint(0, config.vocab_size, {kGlobalBatch, kSeqLen});
  for (const bool wrap : {false, true}) {
    const std::string what = wrap ? "FSDP-sharded" : "unwrapped";
    const std::filesystem::path run = mdist::broadcast(
        (std::filesystem::temp_directory_path() /
         ("mdist-step-checkpoint-" + std::to_string(::getpid()) + (wrap ? "-fsdp" : "")))
            .string());
    CausalLM model = seeded(config);
    if (wrap) mdist::fsdp2_wrap(*model);
    auto opt = adamw(model);
    auto params = model->named_parameters();
    for (int step = 1; step <= 3; ++step) {
      const at::Tensor local = batch.narrow(0, mdist::rank() * (kGlobalBatch / mdist::size()),
                                            kGlobalBatch / mdist::size());
      opt.zero_grad();
      mdist::hf::causal_lm_loss(model->forward(local), local).backward();
      if (!wrap) reduce_gradients(model, mdist::Group::world());
      params[never].mutable_grad() = at::Tensor();
      if (step == 2) params[missed].mutable_grad() = at::Tensor();
      opt.step();
    }
    ASSERT_EQ(state_of(opt, params[missed]).step(), 2) << what;
    ASSERT_FALSE(opt.state().count(params[never].unsafeGetTensorImpl())) << what;
    mdist::train::TrainerState state;
    state.step = 3;
    state.sequences_seen = 3 * kGlobalBatch;
    state.run = nlohmann::json::object();
    const mdist::ParallelState parallel = mdist::make_parallel_state({});
    mdist::train::save_training_checkpoint(run, model, {}, opt, state, 1, parallel);
    const auto checkpoint = mdist::train::latest_checkpoint(run);
    ASSERT_TRUE(checkpoint.has_value()) << what;
    const auto check = mdist::train::check_optimizer_state(*checkpoint, config, 3);
    EXPECT_TRUE(check.per_parameter_steps) << what;
    EXPECT_EQ(check.world_size, mdist::size()) << what;

    CausalLM loaded = seeded(config);
    if (wrap) mdist::fsdp2_wrap(*loaded);
    auto loaded_opt = adamw(loaded);
    mdist::train::load_training_checkpoint(*checkpoint, loaded, {}, loaded_opt,
                                           mdist::train::read_trainer_state(*checkpoint), parallel);
    const auto loaded_params = loaded->named_parameters();
    for (const auto& item : params) {
      void* key = loaded_params[item.key()].unsafeGetTensorImpl();
      if (item.key() == never) {
        EXPECT_FALSE(loaded_opt.state().count(key)) << what << ": " << item.key();
        continue;
      }
      ASSERT_TRUE(loaded_opt.state().count(key)) << what << ": " << item.key();
      const auto& saved = state_of(opt, item.value());
      const auto& got = state_of(loaded_opt, loaded_params[item.key()]);
      EXPECT_EQ(got.step(), item.key() == missed ? 2 : 3) << what << ": " << item.key();
      EXPECT_TRUE(got.exp_avg().equal(saved.exp_avg())) << what << ": " << item.key();
      EXPECT_TRUE(got.exp_avg_sq().equal(saved.exp_avg_sq())) << what << ": " << item.key();
    }
    mdist::barrier();
    if (mdist::is_master()) std::filesystem::remove_all(run);
  }
}

INSTANTIATE_TEST_SUITE_P(Architectures, ExpertParallelCheckpoint,
                         ::testing::Values("qwen3_moe", "mixtral", "qwen2_moe"));

}  // namespace
