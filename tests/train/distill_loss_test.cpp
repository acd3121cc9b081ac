// The knowledge-distillation loss (mdist/train/distill_loss.h), run by mdistrun with 1-4 ranks:
//  - on the whole vocabulary it equals modelopt 0.47's LogitsDistillationLoss reduced as its QAD
//    reduces it (tests/train/make_distill_loss_fixture.py), value and gradient to 1e-6, also
//    with large logits, temperatures 0.5 / 1 / 2 and every label ignored (0, not NaN);
//  - the vocab-parallel form over the world (each rank its V / world columns of both logits)
//    equals the whole one: the same value on every rank, each rank's slice of the gradient;
//  - the causal-LM form shifts as modelopt does (logits at t, label at t + 1).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <string>

#include "mdist/error.h"
#include "mdist/hf/parallelize.h"
#include "mdist/hf/safetensors.h"
#include "mdist/mdist.h"
#include "mdist/train/distill_loss.h"

namespace {

const std::string kFixture = MDIST_DISTILL_LOSS_FIXTURE;

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

struct Case {
  at::Tensor student, teacher, labels, loss, grad;
  double temperature = 1;
};

Case read_case(const std::string& name) {
  const mdist::hf::SafetensorsFile file(kFixture);
  return {.student = file.tensor(name + ".student"),
          .teacher = file.tensor(name + ".teacher"),
          .labels = file.tensor(name + ".labels"),
          .loss = file.tensor(name + ".loss"),
          .grad = file.tensor(name + ".grad"),
          .temperature = file.tensor(name + ".temperature")[0].item<double>()};
}

class DistillLoss : public ::testing::TestWithParam<std::string> {};

TEST_P(DistillLoss, EqualsModeloptOnTheWholeVocabulary) {
  const Case c = read_case(GetParam());
  const at::Tensor student = c.student.clone().requires_grad_(true);
  const at::Tensor loss =
      mdist::train::logits_distillation_loss(student, c.teacher, c.labels, c.temperature);
  const double want = c.loss.item<double>();
  EXPECT_NEAR(loss.item<double>(), want, 1e-6 * std::max(1.0, std::abs(want)));
  loss.backward();
  EXPECT_LT(max_diff(student.grad(), c.grad), 1e-6);
  // The teacher gets no gradient and is not changed.
  EXPECT_FALSE(c.teacher.requires_grad());
}

TEST_P(DistillLoss, VocabParallelEqualsTheWholeVocabulary) {
  const mdist::Group world;
  const int t = mdist::size(), r = mdist::rank();
  const Case c = read_case(GetParam());
  const std::int64_t columns = c.student.size(1) / t;
  ASSERT_EQ(columns * t, c.student.size(1));
  const at::Tensor whole = c.student.clone().requires_grad_(true);
  const at::Tensor expected =
      mdist::train::logits_distillation_loss(whole, c.teacher, c.labels, c.temperature);
  (expected * 3).backward();
  const at::Tensor part = c.student.narrow(1, r * columns, columns).clone().requires_grad_(true);
  const at::Tensor loss = mdist::train::vocab_parallel_logits_distillation_loss(
      part, c.teacher.narrow(1, r * columns, columns), c.labels, c.temperature, world);
  EXPECT_NEAR(loss.item<double>(), expected.item<double>(),
              1e-6 * std::max(1.0, std::abs(expected.item<double>())));
  (loss * 3).backward();
  EXPECT_LT(max_diff(part.grad(), whole.grad().narrow(1, r * columns, columns)), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Fixture, DistillLoss,
                         ::testing::Values("t1", "t2", "t05", "large", "all_ignored"));

TEST(DistillLossCausal, ShiftsAsModelopt) {
  const Case c = read_case("t2");
  // 13 tokens as one row of 13 positions: the loss of positions 0..11 against labels 1..12.
  const at::Tensor student = c.student.unsqueeze(0).clone().requires_grad_(true);
  const at::Tensor labels = c.labels.unsqueeze(0);
  const at::Tensor loss = mdist::train::causal_lm_distillation_loss(
      mdist::hf::Parallelism{}, student, c.teacher.unsqueeze(0), labels, c.temperature);
  const at::Tensor expected = mdist::train::logits_distillation_loss(
      c.student.slice(0, 0, -1), c.teacher.slice(0, 0, -1), c.labels.slice(0, 1), c.temperature);
  EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-7);
  loss.backward();
  // The last position predicts nothing: no gradient there.
  EXPECT_EQ(student.grad()[0][-1].abs().max().item<double>(), 0.0);
}

TEST(DistillLossCausal, RefusesBadArguments) {
  const at::Tensor a = torch::zeros({3, 8});
  const at::Tensor labels = torch::zeros({3}, torch::kLong);
  EXPECT_THROW(mdist::train::logits_distillation_loss(a, a, labels, 0.0), mdist::Error);
  EXPECT_THROW(mdist::train::logits_distillation_loss(a, a, labels, -1.0), mdist::Error);
  EXPECT_THROW(mdist::train::logits_distillation_loss(a, a, labels, std::nan("")), mdist::Error);
  EXPECT_THROW(mdist::train::logits_distillation_loss(a, torch::zeros({3, 9}), labels, 1.0),
               mdist::Error);
}

}  // namespace
