#pragma once
// Building the model a command runs on: loaded or seeded, split and sharded for the job's
// layout through hf::apply_parallelism, with --param-dtype's mixed precision.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/hf/activation_checkpointing.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/hf/parallelize.h"
#include "mdist/quant/quantize.h"
#include "src/cli/job_layout.h"
#include "src/cli/model_choice.h"

namespace mdist::cli {

// Builds the model and shards it with fsdp2_wrap on mdist::compute_device() (cuda:LOCAL_RANK,
// made current by setup(), or the CPU; mdist/runtime/device.h): weights from choice.dir
// (hf::load_pretrained_fsdp2: no rank ever holds the whole model), or HF-style seeded
// initialisation (normal(0, initializer_range) for Linear and Embedding weights,
// ones for norms, zeros for biases), identical on every rank for a given seed whatever the world
// size.
// A checkpoint holding a non-finite value is refused (AgreedInputError naming the tensor), before
// the caller has written anything.
// Either way the model goes through hf::apply_parallelism, the one recipe: with a
// tensor-parallel group in the layout, the model is split over it first (a checkpoint is read
// by slice) and sharded over its data-parallel group; with an expert-parallel group, each rank
// keeps (and reads) only its experts, FSDP-sharded over the expert-data-parallel group.
// Returns the model with its hf::Parallelism (the loss, gradient norm and saving take it).
// `mp_policy`: FSDP2's mixed precision for every unit (train's --param-dtype).
// `activation_checkpointing`: the decoder layers to checkpoint (train's
// --activation-checkpointing), marked before the model is wrapped, as torchtitan orders it.
hf::ParallelModel build_wrapped_model(
    const ModelChoice& choice, std::uint64_t seed, const JobLayout& layout = JobLayout(),
    const std::optional<MixedPrecisionPolicy>& mp_policy = std::nullopt,
    const hf::ActivationCheckpointing& activation_checkpointing = {});

// A quantized checkpoint (choice.quantization) read back as its quantized model: the loader
// has dequantized its weights; this installs the input quantizers with the checkpoint's
// input scales (quant::apply_checkpoint_quantization). Null for an unquantized model. The
// model computes quantized for as long as the result lives; a row-parallel Linear's
// pre_quant_scale is cut to its shard (built.parallelism).
std::unique_ptr<quant::ModelQuantizers> checkpoint_quantizers(const ModelChoice& choice,
                                                              const hf::ParallelModel& built);

// --param-dtype (train, eval, calibrate, generate): nullopt for "" (the weights' own dtype);
// for bf16 (or fp32) the policy torchtitan trains with: every unit all-gathers and computes in that
// dtype and reduce-scatters gradients in fp32, while the shards, their gradients and AdamW's state
// keep the weights' dtype. fp16 is refused (it needs loss scaling, which mdist train does not do),
// as is any other name (InputError naming the flag).
std::optional<MixedPrecisionPolicy> parse_param_dtype(const std::string& name);

// "mixed precision: gathered and computed in bf16, ..." for the log of a command run with
// --param-dtype.
std::string describe_mixed_precision(const MixedPrecisionPolicy& policy, hf::CausalLM& model);

}  // namespace mdist::cli
