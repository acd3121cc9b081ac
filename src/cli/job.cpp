#include "src/cli/job.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include "mdist/hf/expert_parallel.h"
#include "mdist/hf/fsdp2_wrap.h"
#include "mdist/hf/pretrained.h"
#include "mdist/hf/safetensors.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"
#include "mdist/train/checkpoint.h"
#include "src/cli/document_encoder.h"
#include "src/cli/documents.h"

namespace mdist::cli {

void agree_on_inputs(const std::function<void()>& check) {
  std::optional<std::string> problem;
  try {
    check();
  } catch (const InputError& error) {
    problem = error.what();
  }
  const auto problems = allgather(problem);
  for (const auto& p : problems) {
    if (p) throw AgreedInputError(*p, rank() == 0);
  }
}

SetupOptions setup_options(const std::optional<double>& timeout_s) {
  SetupOptions options;
  double seconds = 0;
  std::string source;
  if (timeout_s) {
    seconds = *timeout_s;
    source = "--timeout";
  } else if (const char* env = std::getenv("MDIST_TIMEOUT"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    seconds = std::strtod(env, &end);
    if (end == env || *end != '\0') seconds = std::nan("");
    source = "MDIST_TIMEOUT";
  } else {
    return options;
  }
  if (!std::isfinite(seconds) || !(seconds > 0) || seconds > 1e9) {
    throw InputError(
        source + " must be a positive number of seconds, got " +
        (timeout_s ? flag_value(seconds) : "'" + std::string(std::getenv("MDIST_TIMEOUT")) + "'"));
  }
  options.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000)));
  return options;
}

namespace {

// A run directory of `mdist train` (checkpoints/, no config.json) or its checkpoints/latest
// pointer, as a user types them for --model: the run's latest checkpoint, and how it was found.
std::optional<std::pair<std::filesystem::path, std::string>> run_checkpoint(
    const std::filesystem::path& given) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path run;
  if (fs::is_regular_file(given, ec) && given.filename() == "latest" &&
      given.parent_path().filename() == "checkpoints") {
    run = given.parent_path().parent_path();
  } else if (fs::is_directory(given, ec) && !fs::exists(given / "config.json", ec) &&
             fs::is_directory(given / "checkpoints", ec)) {
    run = given;
  } else {
    return std::nullopt;
  }
  const train::ResumePoint point = train::resume_point(run);
  if (!point.checkpoint) {
    throw InputError("--model '" + given.string() + "': the run '" + run.string() +
                     "' has no complete checkpoint yet");
  }
  std::string how = "the latest checkpoint of the run " + run.string();
  for (const auto& warning : point.warnings) how += "; warning: " + warning;
  return std::pair{*point.checkpoint, how};
}

}  // namespace

ModelChoice model_from_dir(const std::filesystem::path& given) {
  if (const auto found = run_checkpoint(given)) {
    ModelChoice choice = model_from_dir(found->first);
    choice.description =
        found->first.string() + " (" + choice.config.architecture + "; " + found->second + ")";
    return choice;
  }
  const std::filesystem::path& dir = given;
  std::error_code ec;
  const auto status = std::filesystem::status(dir, ec);
  if (!std::filesystem::exists(status)) {
    throw InputError("model directory '" + dir.string() + "' does not exist");
  }
  if (!std::filesystem::is_directory(status)) {
    throw InputError("model directory '" + dir.string() + "' is not a directory");
  }
  const auto config_path = dir / "config.json";
  if (!std::filesystem::exists(config_path, ec)) {
    throw InputError("model directory '" + dir.string() + "' has no config.json");
  }
  if (std::ifstream probe(config_path); !probe) {
    throw InputError("model directory '" + dir.string() +
                     "': cannot read config.json: " + std::strerror(errno));
  }
  ModelChoice choice;
  choice.dir = dir;
  try {
    choice.config = hf::LlamaConfig::from_file(config_path.string());
    // Opens and validates every safetensors file (and the index) up front.
    // and checks them against the config (names, full shapes, dtypes), as from_pretrained.
    const hf::SafetensorsCheckpoint weights(dir);
    (void)hf::check_checkpoint(choice.config, weights);
  } catch (const Error& error) {
    throw InputError("model directory '" + dir.string() + "': " + error.what());
  }
  choice.description = dir.string() + " (" + choice.config.architecture + ")";
  choice.tokenizer = tokenizer_of(dir, false);
  return choice;
}

std::shared_ptr<const hf::Tokenizer> tokenizer_of(const std::filesystem::path& dir, bool required) {
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) {
    throw InputError("model directory '" + dir.string() + "' does not exist");
  }
  if (!std::filesystem::is_directory(dir, ec)) {
    throw InputError("model directory '" + dir.string() + "' is not a directory");
  }
  if (!hf::Tokenizer::exists_in(dir)) {
    if (required) throw InputError("model directory '" + dir.string() + "' has no tokenizer.json");
    return nullptr;
  }
  try {
    return std::make_shared<const hf::Tokenizer>(hf::Tokenizer::from_directory(dir));
  } catch (const Error& error) {
    throw InputError("model directory '" + dir.string() + "': " + error.what());
  }
}

std::string tokenizer_line(const ModelChoice& model) {
  return model.tokenizer ? "tokenizer: " + model.tokenizer->description()
                         : std::string("tokenizer: none, text read as bytes");
}

std::vector<std::filesystem::path> tokenizer_files(const ModelChoice& model) {
  std::vector<std::filesystem::path> files;
  if (!model.dir || !model.tokenizer) return files;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(*model.dir / name, ec)) files.push_back(*model.dir / name);
  }
  return files;
}

ModelChoice default_model() {
  ModelChoice choice;
  choice.config = hf::LlamaConfig::from_json(std::string(embedded_config_json()));
  choice.description = "the embedded default (data/default/config.json, seeded initialisation)";
  return choice;
}

ModelChoice model_for_inference(const std::optional<std::filesystem::path>& dir,
                                const std::filesystem::path& default_run) {
  if (dir) return model_from_dir(*dir);
  if (const auto latest = train::resume_point(default_run).checkpoint) {
    auto choice = model_from_dir(*latest);
    choice.description = latest->string() + " (latest checkpoint of the default training run)";
    return choice;
  }
  auto choice = default_model();
  choice.description += "; no checkpoint in " + default_run.string() +
                        " yet: run `mdist train` to get a trained model";
  return choice;
}

namespace {

void init_weights(hf::CausalLM& model, std::uint64_t seed, double std) {
  const torch::NoGradGuard no_grad;
  torch::manual_seed(seed);
  for (auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    at::Tensor p = item.value();
    const bool norm = name.find("norm.weight") != std::string::npos;
    if (norm) {
      p.fill_(1.0);
    } else if (name.ends_with(".bias")) {
      p.zero_();
    } else {
      p.normal_(0.0, std);
    }
  }
}

}  // namespace

std::optional<MixedPrecisionPolicy> parse_param_dtype(const std::string& name) {
  if (name.empty()) return std::nullopt;
  MixedPrecisionPolicy policy;
  policy.reduce_dtype = at::kFloat;
  if (name == "bf16" || name == "bfloat16") {
    policy.param_dtype = at::kBFloat16;
  } else if (name == "fp32" || name == "float32") {
    policy.param_dtype = at::kFloat;
  } else if (name == "fp16" || name == "float16") {
    throw InputError("--param-dtype " + name +
                     " needs loss scaling, which mdist train does not do; use bf16");
  } else {
    throw InputError(
        "--param-dtype must be bf16 or fp32 (or left out: compute in the weights' "
        "dtype), got '" +
        name + "'");
  }
  return policy;
}

std::string describe_mixed_precision(const MixedPrecisionPolicy& policy, hf::CausalLM& model) {
  const auto name = [](c10::ScalarType t) -> std::string {
    return t == at::kBFloat16 ? "bf16" : t == at::kFloat ? "fp32" : c10::toString(t);
  };
  return "mixed precision: gathered and computed in " +
         name(policy.param_dtype.value_or(at::kFloat)) + ", gradients reduced in " +
         name(policy.reduce_dtype.value_or(at::kFloat)) + ", weights (and AdamW state) in " +
         name(model->parameters().front().scalar_type()) + " (--param-dtype)";
}

hf::ParallelModel build_wrapped_model(const ModelChoice& choice, std::uint64_t seed,
                                      const JobLayout& layout,
                                      const std::optional<MixedPrecisionPolicy>& mp_policy) {
  const ParallelState& parallel = layout.parallel;
  // A checkpoint is loaded without ever holding the whole model: built on the meta device,
  // split and wrapped, then each rank reads only its rows from the memory-mapped safetensors.
  if (choice.dir) {
    hf::Fsdp2LoadOptions options;
    options.parallel = parallel;
    options.expert_data_parallel = layout.expert_data_parallel;
    options.mp_policy = mp_policy;
    hf::ParallelModel loaded = hf::load_pretrained_fsdp2(*choice.dir, options);
    hf::CausalLM model = loaded.model;
    // A NaN or infinite weight makes every number after it meaningless (exit code 0 with a
    // "loss nan"): each rank checks the values it holds, and the ranks agree, so that the job
    // ends with one line before any output exists.
    agree_on_inputs([&] {
      const torch::NoGradGuard no_grad;
      for (const auto& item : model->named_parameters()) {
        if (!at::isfinite(item.value()).all().item<bool>()) {
          throw InputError("model directory '" + choice.dir->string() + "': '" + item.key() +
                           "' holds non-finite values (nan or inf)");
        }
      }
    });
    return loaded;
  }
  hf::CausalLM model(choice.config);
  const auto config = nlohmann::json::parse(choice.config.source_json, nullptr, false);
  const double std = config.is_object() ? config.value("initializer_range", 0.02) : 0.02;
  // On the CPU and whole: the same numbers whatever the device and the layout. (The seeded
  // default is small; a large model comes from a checkpoint, read by slice.)
  init_weights(model, seed, std);
  std::optional<c10::Device> device;
  if (const auto compute = compute_device(); !compute.is_cpu()) device = compute;
  const hf::Parallelism parallelism =
      hf::apply_parallelism(model, {parallel, layout.expert_data_parallel},
                            {.fsdp = true,
                             .shard_root = true,
                             .mp_policy = mp_policy,
                             .cpu_offload = false,
                             .device = device});
  return {model, parallelism};
}

void check_tensor_parallel_size(int tp) { check_tensor_parallel_size(tp, size()); }

void check_tensor_parallel(int tp, const hf::LlamaConfig& config) {
  check_tensor_parallel_size(tp);
  try {
    hf::check_tensor_parallel_split(config, tp);
  } catch (const Error& error) {
    std::string message = error.what();
    if (message.rfind("mdist: ", 0) == 0) message = message.substr(7);
    throw InputError("--tp " + std::to_string(tp) + ": " + message);
  }
}

void check_expert_parallel_size(int ep, int tp) { check_expert_parallel_size(ep, tp, size()); }

void check_expert_parallel(int ep, int tp, const hf::LlamaConfig& config) {
  check_expert_parallel_size(ep, tp);
  if (ep == 1) return;
  const std::string flag = "--ep " + std::to_string(ep) + ": ";
  if (!config.moe) {
    throw InputError(flag + "the model (" + config.model_type +
                     ") has no mixture-of-experts layers to split");
  }
  if (config.moe->num_experts % ep != 0) {
    throw InputError(flag + "num_experts " + std::to_string(config.moe->num_experts) +
                     " is not divisible by " + std::to_string(ep));
  }
}

JobLayout make_layout(int tp, int ep) {
  const ParallelSizes sizes{.tensor_parallel = tp, .expert_model_parallel = ep};
  JobLayout layout{make_parallel_state(sizes), std::nullopt};
  if (ep > 1) layout.expert_data_parallel = make_expert_data_parallel_group(sizes);
  return layout;
}

std::string describe_layout(const JobLayout& layout) {
  const int world = std::max(1, size());
  const int tp = layout.tensor_parallel(), ep = layout.expert_parallel();
  std::string text = std::to_string(world) + " rank(s) as dp " + std::to_string(world / tp) +
                     " x tp " + std::to_string(tp);
  if (ep > 1) {
    text += ", experts over ep " + std::to_string(ep) + " x edp " + std::to_string(world / tp / ep);
  }
  return text;
}

namespace {

// Text through the model's tokenizer: each line a document, encoded as `mdist tokenize` does
// (add_special_tokens, then EOS), so that training on the text and on its tokenized .u32 file
// are the same. The ids are held in memory (4 bytes a token, on every rank): for a large corpus,
// run `mdist tokenize` once and train on its memory-mapped output.
TokenStream tokenized_text(const std::filesystem::path& path, const hf::Tokenizer& tokenizer,
                           DataSplit split, std::int64_t vocab_size) {
  const MappedFile file(path, "data file");
  const DocumentEncoder encoder(tokenizer);
  std::vector<std::int32_t> ids;
  for_each_document(file, 0, file.size(), DocumentOptions{},
                    [&](std::string_view doc, std::size_t) { encoder.encode(doc, ids); });
  return token_stream_of(std::move(ids), path.string(), "text, tokenizer", split, vocab_size);
}

}  // namespace

TokenStream load_data(const ModelDataOptions& options, DataSplit default_split,
                      std::int64_t vocab_size, const hf::Tokenizer* tokenizer) {
  const DataFormat format = parse_data_format(options.data_format);
  DataSplit split = DataSplit::all;
  if (options.split == "auto") {
    split = options.data ? DataSplit::all : default_split;
  } else {
    split = parse_data_split(options.split);
  }
  // The id range check is split across the ranks (agree_on_inputs combines the outcomes).
  if (options.data && tokenizer != nullptr &&
      resolve_data_format(*options.data, format) == DataFormat::text) {
    return tokenized_text(*options.data, *tokenizer, split, vocab_size);
  }
  if (options.data) {
    return load_tokens(*options.data, format, split, vocab_size, {rank(), size()});
  }
  return load_tokens_from_bytes(embedded_corpus(), std::string(kEmbeddedCorpusName) + " [embedded]",
                                DataFormat::text, split, vocab_size);
}

at::Tensor batch_of(const Windows& windows, const std::vector<std::int64_t>& which) {
  const int64_t T = windows.seq_len();
  auto ids = torch::empty({static_cast<int64_t>(which.size()), T}, torch::kInt64);
  auto* out = ids.data_ptr<int64_t>();
  for (std::size_t b = 0; b < which.size(); ++b) {
    windows.copy(which[b], out + static_cast<int64_t>(b) * T);
  }
  return ids;
}

train::SequenceSource sequence_source(const Windows& windows, std::string description,
                                      std::shared_ptr<WindowOrder> order) {
  train::SequenceSource source;
  source.count = windows.count();
  source.length = windows.seq_len();
  source.description = std::move(description);
  source.rows = [&windows, order](const std::vector<std::int64_t>& which) {
    if (!order) return batch_of(windows, which);
    std::vector<std::int64_t> ordered;
    ordered.reserve(which.size());
    for (const std::int64_t position : which) ordered.push_back(order->window_of(position));
    return batch_of(windows, ordered);
  };
  return source;
}

TokenStream load_checked_data(const ModelDataOptions& options, DataSplit default_split,
                              const ModelChoice& model, const char* command) {
  TokenStream data =
      load_data(options, default_split, model.config.vocab_size, model.tokenizer.get());
  const Windows windows(data, options.seq_len, command);
  if (options.seq_len > model.config.max_position_embeddings) {
    throw InputError("--seq-len " + std::to_string(options.seq_len) +
                     " exceeds the model's max_position_embeddings " +
                     std::to_string(model.config.max_position_embeddings));
  }
  return data;
}

namespace {

// The nearest existing ancestor of `path` (itself included); it must be a directory we can
// create files in. Probing by creating a file, not access(2): root passes every access check.
void probe_writable(const std::filesystem::path& dir, const std::filesystem::path& path,
                    const char* what) {
  std::error_code ec;
  std::filesystem::path existing = std::filesystem::absolute(dir, ec);
  while (!std::filesystem::exists(existing, ec)) {
    if (!existing.has_parent_path() || existing.parent_path() == existing) break;
    existing = existing.parent_path();
  }
  if (!std::filesystem::is_directory(existing, ec)) {
    throw InputError(std::string(what) + " '" + path.string() + "' is not writable: '" +
                     existing.string() + "' is not a directory");
  }
  std::string probe = (existing / ".mdist-write-probe-XXXXXX").string();
  const int fd = mkstemp(probe.data());
  if (fd < 0) {
    throw InputError(std::string(what) + " '" + path.string() +
                     "' is not writable: " + std::strerror(errno));
  }
  close(fd);
  unlink(probe.c_str());
}

}  // namespace

void check_writable_dir(const std::filesystem::path& dir, const char* what) {
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec)) {
    throw InputError(std::string(what) + " '" + dir.string() + "' exists and is not a directory");
  }
  probe_writable(dir, dir, what);
}

void check_writable_file(const std::filesystem::path& file, const char* what) {
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec)) {
    throw InputError(std::string(what) + " '" + file.string() + "' is a directory");
  }
  probe_writable(file.has_parent_path() ? file.parent_path() : std::filesystem::path("."), file,
                 what);
}

void configure_threads() {
  if (const char* threads = std::getenv("OMP_NUM_THREADS")) {
    const int n = std::atoi(threads);
    if (n > 0) torch::set_num_threads(n);
  }
}

void say(const std::string& line) {
  if (rank() != 0) return;
  std::cout << line << std::endl;
}

}  // namespace mdist::cli
