#pragma once
// `mdist train --teacher DIR`: knowledge distillation (modelopt's QAD with --quant, plain
// distillation without) on the training library's DistillationLoss. The teacher is checked with
// the other inputs (it loads, it is not quantized, its vocabulary is the student's, the layout
// can split it), then built on the student's layout as its own FSDP root and handed to the loss.
// A resumed run repeats the flags it started with (describe_distillation, in the run's
// metadata) and reloads the teacher from its directory.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/train/distillation.h"
#include "src/cli/job_layout.h"
#include "src/cli/model_choice.h"
#include "src/cli/train_options.h"

namespace mdist::cli {

// The teacher of --teacher (InputError naming --teacher when it does not load, is quantized,
// has another vocabulary size than `student`, or cannot be split over `tensor_parallel`).
// Called inside agree_on_inputs.
ModelChoice check_teacher(const DistillOptions& options, const ModelChoice& student,
                          int tensor_parallel);

// A resumed run: InputError unless `saved` (the checkpoint's run metadata) names the
// distillation of `options` ("none" for a run without --teacher).
void check_resumed_distillation(const nlohmann::json& saved, const DistillOptions& options,
                                const std::filesystem::path& checkpoint);

// The teacher built and sharded on `layout` (collective) and the loss that runs it.
std::unique_ptr<train::DistillationLoss> make_distillation_loss(
    const DistillOptions& options, const ModelChoice& teacher, const hf::LlamaConfig& student,
    double aux_weight, std::uint64_t seed, const JobLayout& layout,
    const std::optional<MixedPrecisionPolicy>& mp_policy);

// The log line: the teacher, the loss and what metrics.jsonl logs.
std::string describe_distillation_run(const DistillOptions& options, const ModelChoice& teacher);

}  // namespace mdist::cli
