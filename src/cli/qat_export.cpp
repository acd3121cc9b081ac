// See src/cli/qat_export.h.
#include "src/cli/qat_export.h"

#include "mdist/hf/safetensors.h"
#include "mdist/io/atomic_file.h"
#include "mdist/quant/export.h"
#include "mdist/runtime/runtime.h"
#include "mdist/train/checkpoint.h"
#include "src/cli/export_dir.h"
#include "src/cli/input_error.h"
#include "src/cli/train_quant.h"

namespace mdist::cli {

namespace fs = std::filesystem;

void write_quantized_export(hf::CausalLM& model, const quant::ModelQuantizers& quantizers,
                            const hf::Parallelism& parallelism,
                            const std::vector<fs::path>& tokenizer_files, const fs::path& out,
                            const std::string& report) {
  const fs::path staging = staging_dir(out);
  if (rank() == 0) fs::remove_all(staging);
  barrier();
  quant::export_hf_checkpoint(model, quantizers, staging, parallelism);
  if (rank() == 0) {
    copy_into(tokenizer_files, staging);
    if (!report.empty()) io::write_file_atomically(staging / "quantize.json", report);
    publish(staging, out);
  }
  barrier();
}

QatRun find_qat_run(const fs::path& run, const std::string& flag) {
  std::error_code ec;
  if (!fs::is_directory(run, ec)) {
    throw InputError(flag + " '" + run.string() + "' is not a directory");
  }
  QatRun found;
  if (fs::exists(run / "config.json", ec)) {
    found.checkpoint = run;
  } else if (fs::is_directory(run / "checkpoints", ec)) {
    const train::ResumePoint point = train::resume_point(run);
    if (!point.checkpoint) {
      throw InputError(flag + " '" + run.string() + "': the run has no complete checkpoint");
    }
    found.checkpoint = *point.checkpoint;
  } else {
    throw InputError(flag + " '" + run.string() +
                     "' is neither a run directory of mdist train (checkpoints/) nor one of its "
                     "checkpoints (config.json)");
  }
  const fs::path state = found.checkpoint / kQatStateFile;
  if (!fs::exists(state, ec)) {
    throw InputError(flag + " '" + run.string() + "': the checkpoint " + found.checkpoint.string() +
                     " has no " + kQatStateFile +
                     ": it was not trained with --quant (quantization-aware training)");
  }
  try {
    const hf::SafetensorsFile file(state);
    const auto& metadata = file.metadata();
    const auto quant = metadata.find("quant");
    if (quant == metadata.end() || quant->second.empty() || quant->second == "none") {
      throw InputError(state.string() + " does not name its quantization format");
    }
    found.description = quant->second;
    // describe_qat: the format, then its details after a space.
    found.format = quant->second.substr(0, quant->second.find(' '));
    // describe_qat names --kv-cache F as "kv-cache F, " among the details. The export must
    // insert the KV cache's quantizers as the run did, or their k/v scales are not written.
    const std::string kv = "kv-cache ";
    if (const auto at = quant->second.find(kv); at != std::string::npos) {
      const auto from = at + kv.size();
      found.kv_cache = quant->second.substr(from, quant->second.find(',', from) - from);
    }
  } catch (const Error& error) {  // an InputError above, or a file that does not parse
    throw InputError(flag + " '" + run.string() + "': " + error.what());
  }
  return found;
}

}  // namespace mdist::cli
