#pragma once
// `mdist train`'s distillation flags (--teacher, --distill-temperature, --distill-ce-weight):
// their defaults, declaration and checks, apart from the other training flags.
#include <filesystem>
#include <optional>
#include <string>

#include "src/cli/flags.h"

namespace mdist::cli {

struct DistillOptions {
  // --teacher DIR: knowledge distillation from that model (an HF directory or a run); nullopt:
  // none. --distill-temperature T (default 1) and --distill-ce-weight W (default 0: KD alone, as
  // modelopt's QAD) apply to it only; nullopt while not given.
  std::optional<std::filesystem::path> teacher;
  std::optional<double> temperature;
  std::optional<double> ce_weight;

  double temperature_or_default() const { return temperature.value_or(1.0); }
  double ce_weight_or_default() const { return ce_weight.value_or(0.0); }
};

void declare_distill_flags(CLI::App& app, DistillOptions& options);
// InputError naming the first bad flag: --distill-* without --teacher, a temperature that is
// not a finite positive number, a negative or non-finite weight; `expert_parallel` > 1 (not
// supported with a teacher yet).
void check_distill_flags(const DistillOptions& options, int expert_parallel);
// The run's metadata entry (kept in checkpoints, compared on --resume): "none", or the
// teacher's absolute path with the temperature and the weight.
std::string describe_distillation(const DistillOptions& options);

}  // namespace mdist::cli
