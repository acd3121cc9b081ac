#pragma once
// Training checkpoints of the trainer (mdist train), in RUN/checkpoints/step-NNNNNNNN/:
//   config.json, model.safetensors (or shards + index)   the Hugging Face layout, loadable by
//                                                        transformers and by --model
//   optimizer/rank-RRRRR-of-WWWWW.safetensors            each rank's block of AdamW's moments,
//                                                        each parameter's step, its generator
//   trainer_state.json                                   step, data position, RNG, run flags
// and RUN/checkpoints/latest naming the newest. A checkpoint is written into a hidden temporary
// directory and renamed into place only once every rank has finished its part, so a crash
// mid-save leaves the previous checkpoint intact and `latest` never names a partial one.
// The optimizer state is stored by blocks of the full (HF-layout) parameters: rows, and for a
// tensor-parallel row-parallel weight also columns, each written by the one rank that holds
// the first copy; experts split by expert parallelism under their global names, by the ranks
// holding them (the first of their expert-data-parallel group for a whole one). So a checkpoint
// written on one (dp, tp) or (dp, ep) layout resumes on any other. The directory must be on a
// file system every rank sees.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "mdist/groups/parallel_state.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/hf/parallelize.h"

namespace torch::optim {
class Optimizer;
}

namespace mdist::train {

struct TrainerState {
  int step = 0;                     // optimizer steps done
  std::int64_t sequences_seen = 0;  // data position: sequences of the window order consumed
  nlohmann::json run;               // the run's flags (seq_len, global_batch, seed, data, ...)
  std::string rng_state_hex;        // libtorch's default CPU generator
  int skipped_steps = 0;            // steps skipped as non-finite (--skip-nonfinite-steps)
};

// Collective. `keep`: how many checkpoints to keep (older ones are removed, and so are those
// of later steps, left by an earlier run in the same directory). `carried`: files copied into
// the checkpoint as they are (the model's tokenizer files, so that a checkpoint is a usable
// Hugging Face model directory). `parallelism`: how the model is split (build_wrapped_model's).
void save_training_checkpoint(const std::filesystem::path& run_dir, hf::CausalLM& model,
                              const hf::Parallelism& parallelism,
                              torch::optim::Optimizer& optimizer, const TrainerState& state,
                              int keep, const ParallelState& parallel = ParallelState(),
                              const std::vector<std::filesystem::path>& carried = {});

// The newest complete checkpoint of a run, if any (lenient: for messages about a run).
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& run_dir);

// The checkpoint a run continues from (--resume, --model RUN_DIR): the one `latest` names.
// Without `latest` (a first save interrupted before writing it), the newest complete step, with
// a warning; so too a newer complete step than `latest`'s, or an interrupted save beyond it,
// each one warning line. Damage that no interrupted save leaves (`latest` naming a directory
// that is not there, the newest step directory or latest's without trainer_state.json) is an
// InputError naming it, rather than a silent fall-back that loses training.
struct ResumePoint {
  std::optional<std::filesystem::path> checkpoint;  // none: the run has no checkpoint
  std::vector<std::string> warnings;
};
ResumePoint resume_point(const std::filesystem::path& run_dir);

// Reads and validates trainer_state.json: InputError naming the file and the field when it is
// missing, malformed or inconsistent (a step below 1 or not the directory's, a data position
// that is not step x global_batch, a layout that does not divide, an RNG state of the wrong
// size).
TrainerState read_trainer_state(const std::filesystem::path& checkpoint);

// What check_optimizer_state found.
struct OptimizerStateCheck {
  // Whether each parameter's own AdamW step is kept (format v3). An older checkpoint's
  // parameters resume at the trainer's step, which is exact only for parameters that were
  // stepped at every step (no expert left without tokens, no skipped step).
  bool per_parameter_steps = true;
  int world_size = 0;  // of the writing job (0: no optimizer state)
};

// Validates the optimizer files of a checkpoint for a model of `config` before anything is
// loaded: every rank's file present, readable and of mdist's format, and for every parameter
// either its AdamW moments (float32, inside the parameter's full shape and covering it) and
// its own step, or its name on a writer's list of parameters without state (no gradient yet).
// InputError naming the file and the tensor otherwise. Rank-local (each rank reads the file
// headers).
OptimizerStateCheck check_optimizer_state(const std::filesystem::path& checkpoint,
                                          const hf::LlamaConfig& config, int step);

// Loads the optimizer's state (each rank its own rows of the moments, each parameter's step;
// a parameter saved without state gets none, as torch's AdamW) and restores the RNG (each
// rank its own when the world size is the writer's). The model's weights are not read here: a
// resumed model is built from the checkpoint directory itself (build_wrapped_model). The
// optimizer must hold the model's parameters.
void load_training_checkpoint(const std::filesystem::path& checkpoint, hf::CausalLM& model,
                              const hf::Parallelism& parallelism,
                              torch::optim::Optimizer& optimizer, const TrainerState& state,
                              const ParallelState& parallel = ParallelState());

}  // namespace mdist::train
