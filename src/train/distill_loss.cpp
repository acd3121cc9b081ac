// See mdist/train/distill_loss.h.
#include "mdist/train/distill_loss.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <sstream>
#include <string>

#include "mdist/error.h"
#include "mdist/hf/tensor_parallel.h"

namespace mdist::train {
namespace {

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

// d loss / d student = T * (softmax(s / T) - softmax(t / T)) * weight, on this rank's columns.
struct DistillationBackward : torch::autograd::Node {
  at::Tensor difference;  // [N, Vl] fp32: softmax(s / T) - softmax(t / T), times T
  at::Tensor weight;      // [N] fp32: 1 / count for a counted token, 0 otherwise
  c10::ScalarType dtype = c10::kFloat;
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor scale = (weight * grads[0].to(at::kFloat)).unsqueeze(1);
    return {(difference * scale).to(dtype)};
  }
  std::string name() const override { return "mdist::train::DistillationBackward"; }
};

// Both entry points: `group` null for the whole vocabulary on this rank.
at::Tensor distillation_loss(const at::Tensor& student, const at::Tensor& teacher,
                             const at::Tensor& labels, double temperature, const Group* group,
                             std::int64_t ignore_index, const tp::Counters& counters,
                             const char* op) {
  if (student.dim() != 2 || teacher.sizes() != student.sizes() || labels.dim() != 1 ||
      labels.size(0) != student.size(0)) {
    throw Error(std::string("mdist::train::") + op + ": student logits " + shape_of(student) +
                ", teacher logits " + shape_of(teacher) + " and labels " + shape_of(labels) +
                " are not [N, V], [N, V] and [N]");
  }
  if (!(std::isfinite(temperature) && temperature > 0)) {
    throw Error(std::string("mdist::train::") + op + ": the temperature must be positive, got " +
                std::to_string(temperature));
  }
  const auto reduce = [&](at::Tensor& tensor, const char* how) {
    if (group != nullptr) tp::all_reduce_(tensor, *group, how, counters);
  };
  // Asked before the no-grad scope below, where grad mode is off.
  const bool wants_gradient = at::GradMode::is_enabled() && student.requires_grad();
  at::Tensor per_token, difference;
  {
    const at::NoGradGuard no_grad;
    const at::Tensor s = student.detach().to(at::kFloat) / temperature;
    const at::Tensor t = teacher.detach().to(at::kFloat) / temperature;
    // The row maxima of both over the whole vocabulary (one all-reduce), for stable exponents.
    at::Tensor maxima = at::stack({std::get<0>(s.max(1)), std::get<0>(t.max(1))}).contiguous();
    reduce(maxima, "max");
    const at::Tensor s_shifted = s - maxima[0].unsqueeze(1);
    const at::Tensor t_shifted = t - maxima[1].unsqueeze(1);
    const at::Tensor s_exp = s_shifted.exp();
    const at::Tensor t_exp = t_shifted.exp();
    at::Tensor sums = at::stack({s_exp.sum(1), t_exp.sum(1)}).contiguous();
    reduce(sums, "sum");
    const at::Tensor s_log_sum = sums[0].log().unsqueeze(1);
    const at::Tensor t_log_sum = sums[1].log().unsqueeze(1);
    // Elementwise p_t (log p_t - log q_s), summed over the vocabulary, as modelopt's kl_div
    // then sum(-1): the per-element form keeps the small divergence of close distributions
    // free of the cancellation a closed form over the row sums would suffer.
    const at::Tensor teacher_probs = t_exp / sums[1].unsqueeze(1);
    const at::Tensor teacher_log_probs = t_shifted - t_log_sum;
    const at::Tensor student_log_probs = s_shifted - s_log_sum;
    per_token = (teacher_probs * (teacher_log_probs - student_log_probs)).sum(1).contiguous();
    reduce(per_token, "sum");
    per_token = per_token * (temperature * temperature);
    if (wants_gradient) {
      difference = (student_log_probs.exp() - teacher_probs) * temperature;
    }
  }
  const at::Tensor valid = labels.to(student.device()) != ignore_index;
  const at::Tensor weight = valid.to(at::kFloat) / valid.sum().clamp_min(1).to(at::kFloat);
  at::Tensor loss = (per_token * weight).sum();
  if (difference.defined()) {
    auto node = c10::make_intrusive<DistillationBackward>();
    node->difference = difference;
    node->weight = weight;
    node->dtype = student.scalar_type();
    node->set_next_edges(torch::autograd::collect_next_edges(student));
    torch::autograd::impl::set_gradient_edge(
        loss, torch::autograd::Edge(node, node->add_input_metadata(loss)));
  }
  return loss;
}

}  // namespace

at::Tensor logits_distillation_loss(const at::Tensor& student, const at::Tensor& teacher,
                                    const at::Tensor& labels, double temperature,
                                    std::int64_t ignore_index) {
  return distillation_loss(student, teacher, labels, temperature, nullptr, ignore_index, nullptr,
                           "logits_distillation_loss");
}

at::Tensor vocab_parallel_logits_distillation_loss(const at::Tensor& student,
                                                   const at::Tensor& teacher,
                                                   const at::Tensor& labels, double temperature,
                                                   const Group& group, std::int64_t ignore_index,
                                                   const tp::Counters& counters) {
  return distillation_loss(student, teacher, labels, temperature, &group, ignore_index, counters,
                           "vocab_parallel_logits_distillation_loss");
}

at::Tensor causal_lm_distillation_loss(const hf::Parallelism& parallelism,
                                       const at::Tensor& student, const at::Tensor& teacher,
                                       const at::Tensor& labels, double temperature) {
  if (student.dim() != 3 || teacher.sizes() != student.sizes() || labels.dim() != 2 ||
      labels.size(0) != student.size(0) || labels.size(1) != student.size(1)) {
    throw Error("mdist::train::causal_lm_distillation_loss: student logits " + shape_of(student) +
                ", teacher logits " + shape_of(teacher) + " and labels " + shape_of(labels) +
                " are not [B, T, V], [B, T, V] and [B, T]");
  }
  const std::int64_t vocab = student.size(2);
  const at::Tensor s = student.slice(1, 0, -1).reshape({-1, vocab});
  const at::Tensor t = teacher.slice(1, 0, -1).reshape({-1, vocab});
  const at::Tensor y = labels.slice(1, 1).reshape({-1});
  if (parallelism.tensor_parallel_split()) {
    const auto& plan = *parallelism.tensor_parallel;
    return vocab_parallel_logits_distillation_loss(s, t, y, temperature, plan.group(), -100,
                                                   plan.counters());
  }
  return logits_distillation_loss(s, t, y, temperature);
}

}  // namespace mdist::train
