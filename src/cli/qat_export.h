#pragma once
// The unified Hugging Face checkpoint of a quantization-aware training run, written from its
// trained weights and its frozen, calibrated quantizers, without calibrating again:
//  - `mdist train --quant F --export-quantized DIR` after the run's last step, from the model
//    as it is in memory (any layout: one rank, FSDP2, tensor parallel);
//  - `mdist quantize --from-run RUN --out DIR` from a run directory (its latest checkpoint) or
//    one of its checkpoints: the weights and kQatStateFile it carries.
// Both write through quant::export_hf_checkpoint, the writer of `mdist quantize`, so the same
// run gives the same bytes either way.
#include <filesystem>
#include <string>
#include <vector>

#include "mdist/hf/parallelize.h"
#include "mdist/quant/quantize.h"

namespace mdist::cli {

// Writes the export of `model` with `quantizers` into `out` (checked by check_export_dir
// beforehand): staged beside it, the tokenizer files copied, `report` (when not empty) as
// quantize.json, then published (src/cli/export_dir.h), so a failure leaves `out` as it was.
// Collective over every rank of the job; rank 0 writes.
void write_quantized_export(hf::CausalLM& model, const quant::ModelQuantizers& quantizers,
                            const hf::Parallelism& parallelism,
                            const std::vector<std::filesystem::path>& tokenizer_files,
                            const std::filesystem::path& out, const std::string& report = {});

// A checkpoint of a quantization-aware run, as `mdist quantize --from-run` takes it.
struct QatRun {
  std::filesystem::path checkpoint;  // the HF directory with kQatStateFile beside the weights
  std::string format;                // the run's --quant (fp8, int8, ...)
  std::string description;           // the run's quant line (describe_qat), for the log
  std::string kv_cache;              // the run's --kv-cache (empty: the KV cache not quantized)
};

// RUN: a run directory of `mdist train` (its latest complete checkpoint) or a checkpoint
// directory. InputError when it is neither, or when the checkpoint was not trained with
// --quant (no kQatStateFile, or one that does not name its format). Every format of --quant,
// with or without --kv-cache, exports. `flag` names the option.
QatRun find_qat_run(const std::filesystem::path& run, const std::string& flag);

}  // namespace mdist::cli
