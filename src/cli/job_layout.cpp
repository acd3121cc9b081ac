#include "src/cli/job_layout.h"

#include "mdist/hf/expert_parallel.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/runtime/runtime.h"
#include "src/cli/flags.h"
#include "src/cli/input_error.h"

namespace mdist::cli {

void check_tensor_parallel_size(int tp) { check_tensor_parallel_size(tp, size()); }

void check_tensor_parallel(int tp, const hf::LlamaConfig& config) {
  check_tensor_parallel_size(tp);
  try {
    hf::check_tensor_parallel_split(config, tp);
  } catch (const Error& error) {
    std::string message = error.what();
    if (message.rfind("mdist: ", 0) == 0) message = message.substr(7);
    throw InputError("--tp " + std::to_string(tp) + ": " + message);
  }
}

void check_expert_parallel_size(int ep, int tp) { check_expert_parallel_size(ep, tp, size()); }

void check_expert_parallel(int ep, int tp, const hf::LlamaConfig& config) {
  check_expert_parallel_size(ep, tp);
  if (ep == 1) return;
  const std::string flag = "--ep " + std::to_string(ep) + ": ";
  if (!config.moe) {
    throw InputError(flag + "the model (" + config.model_type +
                     ") has no mixture-of-experts layers to split");
  }
  if (config.moe->num_experts % ep != 0) {
    throw InputError(flag + "num_experts " + std::to_string(config.moe->num_experts) +
                     " is not divisible by " + std::to_string(ep));
  }
}

JobLayout make_layout(int tp, int ep) {
  const ParallelSizes sizes{.tensor_parallel = tp, .expert_model_parallel = ep};
  JobLayout layout{make_parallel_state(sizes), std::nullopt};
  if (ep > 1) layout.expert_data_parallel = make_expert_data_parallel_group(sizes);
  return layout;
}

std::string describe_layout(const JobLayout& layout) {
  const int world = std::max(1, size());
  const int tp = layout.tensor_parallel(), ep = layout.expert_parallel();
  std::string text = std::to_string(world) + " rank(s) as dp " + std::to_string(world / tp) +
                     " x tp " + std::to_string(tp);
  if (ep > 1) {
    text += ", experts over ep " + std::to_string(ep) + " x edp " + std::to_string(world / tp / ep);
  }
  return text;
}

}  // namespace mdist::cli
