// clip_grad_norm_ over a wrapped model: sharded gradients summed over the group, whole
// (replicated) ones counted once, with one device sync and one collective.
#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <optional>
#include <unordered_set>

#include "mdist/error.h"
#include "mdist/fsdp/state_dict.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"
#include "src/fsdp/fsdp_state.h"

namespace mdist {

namespace {

double clip(torch::nn::Module& model, double max_norm, double norm_type,
            const GradNormScope* scope) {
  const bool inf = std::isinf(norm_type) && norm_type > 0;
  if (!inf && norm_type != 2.0) {
    throw Error("mdist: clip_grad_norm_: norm_type must be 2 or infinity, got " +
                std::to_string(norm_type));
  }
  const at::NoGradGuard no_grad;
  std::optional<Group> group;
  bool mixed_groups = false;
  std::vector<at::Tensor> grads;
  // Per device, each gradient's part (sum of squares, or max of abs) as a 0-d double tensor,
  // sharded and replicated apart; stacked and copied to the host once per device.
  struct Parts {
    std::vector<at::Tensor> sharded;
    std::vector<at::Tensor> replicated;
  };
  std::map<std::pair<int, int>, Parts> parts;
  std::unordered_set<const c10::TensorImpl*> seen;  // a tied parameter is listed twice
  for (const auto& item : model.named_parameters()) {
    const at::Tensor& param = item.value();
    if (!seen.insert(param.unsafeGetTensorImpl()).second) continue;
    const at::Tensor grad = param.grad();
    if (!grad.defined()) continue;
    grads.push_back(grad);  // clipped whether counted here or not
    if (scope != nullptr && !scope->counted(item.key())) continue;
    const at::Tensor wide = grad.to(at::kDouble);
    at::Tensor part = inf ? wide.abs().max() : wide.pow(2).sum();
    if (grad.numel() == 0) part = at::zeros({}, wide.options());
    auto& bucket =
        parts[{static_cast<int>(grad.device().type()), static_cast<int>(grad.device().index())}];
    if (const auto managed = detail::find_managed(param)) {
      const Group& unit_group = managed->unit->options.group;
      if (group && !(*group == unit_group)) {
        // Expert parallelism: experts over their expert-data-parallel group, the rest over
        // data parallel. Only a scope says which ranks' shards add up to the whole.
        if (scope == nullptr) {
          throw Error(
              "mdist: clip_grad_norm_: the model's units use different groups; pass a "
              "GradNormScope whose group spans them (hf::clip_grad_norm_ does for expert "
              "parallelism)");
        }
        mixed_groups = true;
      } else if (!group) {
        group = unit_group;
      }
      bucket.sharded.push_back(std::move(part));
    } else {
      bucket.replicated.push_back(std::move(part));
    }
  }
  const auto combine = [inf](double a, double b) { return inf ? std::max(a, b) : a + b; };
  double sharded = 0;
  double replicated = 0;
  for (const auto& [device, bucket] : parts) {
    std::vector<at::Tensor> all = bucket.sharded;
    all.insert(all.end(), bucket.replicated.begin(), bucket.replicated.end());
    const at::Tensor host = at::stack(all).to(at::kCPU);
    const double* values = host.data_ptr<double>();
    for (std::size_t i = 0; i < all.size(); ++i) {
      double& total = i < bucket.sharded.size() ? sharded : replicated;
      total = combine(total, values[i]);
    }
  }
  // Whole parameters are the same on every rank of their unit's group: counted on its rank 0
  // (without units and without a scope, on rank 0 of the world; with a scope, where it says).
  const Group over = scope != nullptr ? scope->group : group.value_or(Group::world());
  // With units over different groups (and so a scope), `counted` alone says where a whole
  // parameter counts: no one unit group's rank 0 stands for them all.
  const bool whole_here =
      mixed_groups || (group ? is_master(*group) : (scope != nullptr || is_master(over)));
  double total = 0;
  if (inf) {
    total = allreduce(std::max(sharded, replicated), "max", over);
  } else {
    total = std::sqrt(allreduce(sharded + (whole_here ? replicated : 0.0), "sum", over));
  }
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    for (auto& grad : grads) grad.mul_(coef);
  }
  return total;
}

}  // namespace

double clip_grad_norm_(torch::nn::Module& model, double max_norm, double norm_type) {
  return clip(model, max_norm, norm_type, nullptr);
}

double clip_grad_norm_(torch::nn::Module& model, double max_norm, double norm_type,
                       const GradNormScope& scope) {
  if (!scope.counted) throw Error("mdist: clip_grad_norm_: the scope needs a counted function");
  return clip(model, max_norm, norm_type, &scope);
}

}  // namespace mdist
