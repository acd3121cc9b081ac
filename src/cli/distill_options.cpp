// See src/cli/distill_options.h.
#include "src/cli/distill_options.h"

#include <CLI/CLI.hpp>

#include <cmath>

#include "mdist/error.h"

namespace mdist::cli {

void declare_distill_flags(CLI::App& app, DistillOptions& o) {
  app.add_option("--teacher", o.teacher,
                 "Knowledge distillation (modelopt's QAD with --quant): train on the KD loss "
                 "against this model's logits (an HF directory or a run; same vocabulary size), "
                 "run under no-grad on the same layout")
      ->type_name("DIR");
  app.add_option("--distill-temperature", o.temperature,
                 "With --teacher: the KD loss's temperature T (T^2 KL(softmax(t/T) || "
                 "softmax(s/T)); default 1)")
      ->type_name("T");
  app.add_option("--distill-ce-weight", o.ce_weight,
                 "With --teacher: add W x the cross entropy to the KD loss (default 0: KD alone, "
                 "as modelopt's QAD)")
      ->type_name("W");
}

void check_distill_flags(const DistillOptions& o, int expert_parallel) {
  if (!o.teacher) {
    const char* needs_teacher = o.temperature ? "--distill-temperature"
                                : o.ce_weight ? "--distill-ce-weight"
                                              : nullptr;
    if (needs_teacher != nullptr) {
      throw InputError(std::string(needs_teacher) +
                       " applies to distillation only: add --teacher DIR");
    }
    return;
  }
  if (o.temperature && !(std::isfinite(*o.temperature) && *o.temperature > 0)) {
    throw InputError("--distill-temperature must be a finite number > 0, got " +
                     flag_value(*o.temperature));
  }
  if (o.ce_weight && !(std::isfinite(*o.ce_weight) && *o.ce_weight >= 0)) {
    throw InputError("--distill-ce-weight must be a finite number >= 0 (0: KD alone), got " +
                     flag_value(*o.ce_weight));
  }
  if (expert_parallel != 1) {
    throw InputError("--teacher with --ep " + std::to_string(expert_parallel) +
                     ": distillation does not support expert parallelism yet");
  }
}

std::string describe_distillation(const DistillOptions& o) {
  if (!o.teacher) return "none";
  return "teacher " + std::filesystem::absolute(*o.teacher).lexically_normal().string() +
         ", temperature " + flag_value(o.temperature_or_default()) + ", cross entropy weight " +
         flag_value(o.ce_weight_or_default());
}

}  // namespace mdist::cli
