// See src/cli/train_distill.h.
#include "src/cli/train_distill.h"

#include "mdist/error.h"
#include "src/cli/model_build.h"

namespace mdist::cli {

ModelChoice check_teacher(const DistillOptions& o, const ModelChoice& student,
                          int tensor_parallel) {
  ModelChoice teacher;
  try {
    teacher = model_from_dir(*o.teacher);
    check_not_quantized(teacher, "train --teacher");
    check_tensor_parallel(tensor_parallel, teacher.config);
  } catch (const InputError& error) {
    throw InputError(std::string("--teacher: ") + error.what());
  }
  if (teacher.config.vocab_size != student.config.vocab_size) {
    throw InputError("--teacher '" + o.teacher->string() + "' has a vocabulary of " +
                     std::to_string(teacher.config.vocab_size) + " tokens, the model trained " +
                     std::to_string(student.config.vocab_size) +
                     "; distillation needs the same vocabulary");
  }
  return teacher;
}

void check_resumed_distillation(const nlohmann::json& saved, const DistillOptions& o,
                                const std::filesystem::path& checkpoint) {
  const std::string was = saved.contains("distillation") ? saved["distillation"].get<std::string>()
                                                         : std::string("none");
  const std::string now = describe_distillation(o);
  if (was != now) {
    throw InputError("--resume: the distillation is '" + now + "' but the checkpoint " +
                     checkpoint.string() + " was trained with '" + was +
                     "'; resume with the --teacher and --distill-* flags the run started with");
  }
}

std::unique_ptr<train::DistillationLoss> make_distillation_loss(
    const DistillOptions& o, const ModelChoice& teacher, const hf::LlamaConfig& student,
    double aux_weight, std::uint64_t seed, const JobLayout& layout,
    const std::optional<MixedPrecisionPolicy>& mp_policy) {
  // The student's layout and precision, no activation checkpointing (no backward).
  hf::ParallelModel built = build_wrapped_model(teacher, seed, layout, mp_policy);
  return std::make_unique<train::DistillationLoss>(
      std::move(built), student, aux_weight,
      train::DistillationSettings{.temperature = o.temperature_or_default(),
                                  .ce_weight = o.ce_weight_or_default()});
}

std::string describe_distillation_run(const DistillOptions& o, const ModelChoice& teacher) {
  const double weight = o.ce_weight_or_default();
  return "mdist train: distillation from teacher " + teacher.description +
         " (no-grad, eval mode, sharded on the same layout): loss = KD (T^2 KL(teacher || "
         "student), temperature " +
         flag_value(o.temperature_or_default()) + ")" +
         (weight > 0 ? " + " + flag_value(weight) + " x cross entropy" : std::string()) +
         "; metrics.jsonl logs kd_loss and cross_entropy, the held-out loss is the cross entropy";
}

}  // namespace mdist::cli
