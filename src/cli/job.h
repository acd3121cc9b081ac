#pragma once
// What every subcommand of `mdist` shares: joining the job, agreeing on bad input before any
// output exists, choosing and building the model, and the data split across data-parallel
// ranks.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mdist/fsdp/fully_shard.h"
#include "mdist/groups/parallel_state.h"
#include "mdist/hf/causal_lm.h"
#include "mdist/hf/parallelize.h"
#include "mdist/hf/tokenizer.h"
#include "mdist/runtime/device.h"
#include "mdist/runtime/runtime.h"
#include "mdist/train/memory.h"
#include "mdist/train/sequences.h"
#include "src/cli/commands.h"
#include "src/cli/flags.h"
#include "src/cli/input_error.h"
#include "src/cli/token_data.h"

namespace mdist::cli {

// The collective timeout of a subcommand: --timeout SECONDS if given, else MDIST_TIMEOUT,
// else 30 minutes (torch's default). Throws InputError for a value that is not a positive
// finite number of seconds (read before the job is joined: rank 0 of the environment reports).
SetupOptions setup_options(const std::optional<double>& timeout_s);

// Runs `check` on every rank, then (collectively) compares outcomes: when any rank threw an
// InputError, every rank throws AgreedInputError carrying the lowest such rank's message. So a
// bad input ends the job with one line and no half-created output, and a problem seen on one
// rank only (a file missing on one node) is still reported.
void agree_on_inputs(const std::function<void()>& check);

// The shipped defaults (compiled into the binary, see src/cli/embedded_data.cmake).
std::string_view embedded_config_json();
std::string_view embedded_corpus();
inline constexpr const char* kEmbeddedCorpusName = "data/corpus/macbeth.txt";

// The model a command runs on: a Hugging Face directory, or the embedded default config with a
// seeded initialisation.
struct ModelChoice {
  std::optional<std::filesystem::path> dir;
  hf::LlamaConfig config;
  std::string description;  // for the log
  // The directory's tokenizer.json (with tokenizer_config.json), if it has one: text data is
  // then tokenized with it, and generate encodes and decodes with it.
  std::shared_ptr<const hf::Tokenizer> tokenizer;
};

// DIR's tokenizer (InputError naming the directory and the problem when tokenizer.json is
// malformed or unsupported); null when DIR has no tokenizer.json, or an InputError when
// `required`.
std::shared_ptr<const hf::Tokenizer> tokenizer_of(const std::filesystem::path& dir, bool required);
// "tokenizer: <description>" or "tokenizer: none, text read as bytes", for the log.
std::string tokenizer_line(const ModelChoice& model);
// The tokenizer files of the model's directory that a checkpoint carries along.
std::vector<std::filesystem::path> tokenizer_files(const ModelChoice& model);

// Checks a model directory (exists, readable, config.json of a supported architecture,
// safetensors present and valid); throws InputError naming the problem. A run directory of
// `mdist train` (RUN, or RUN/checkpoints/latest) stands for the run's latest checkpoint
// (resume_point: a damaged one is refused), which the description names.
ModelChoice model_from_dir(const std::filesystem::path& dir);
ModelChoice default_model();
// `dir` if given; else the latest checkpoint of `default_run` (a default `mdist train`) if there
// is one; else the embedded default.
ModelChoice model_for_inference(const std::optional<std::filesystem::path>& dir,
                                const std::filesystem::path& default_run);

// The job's groups: the spec's ParallelState (data, tensor and expert parallel) and, with
// expert parallelism, the expert-data-parallel group (the ranks holding the same experts, over
// which the experts are FSDP-sharded; Megatron's layout, dp = ep x edp).
struct JobLayout {
  ParallelState parallel;
  std::optional<Group> expert_data_parallel;  // set when --ep > 1
  int tensor_parallel() const { return std::max(1, parallel.tensor_parallel_group.world_size()); }
  int expert_parallel() const {
    return std::max(1, parallel.expert_model_parallel_group.world_size());
  }
};

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
hf::ParallelModel build_wrapped_model(
    const ModelChoice& choice, std::uint64_t seed, const JobLayout& layout = JobLayout(),
    const std::optional<MixedPrecisionPolicy>& mp_policy = std::nullopt);

// --param-dtype (train, eval, calibrate, generate): nullopt for "" (the weights' own dtype);
// for bf16 (or fp32) the policy torchtitan trains with: every unit all-gathers and computes in that
// dtype and reduce-scatters gradients in fp32, while the shards, their gradients and AdamW's state
// keep the weights' dtype. fp16 is refused (it needs loss scaling, which mdist train does not do),
// as is any other name (InputError naming the flag).
std::optional<MixedPrecisionPolicy> parse_param_dtype(const std::string& name);

// "mixed precision: gathered and computed in bf16, ..." for the log of a command run with
// --param-dtype.
std::string describe_mixed_precision(const MixedPrecisionPolicy& policy, hf::CausalLM& model);

// Checks --tp against the world and the model (InputError naming the sizes); call inside
// agree_on_inputs.
void check_tensor_parallel_size(int tensor_parallel);  // >= 1 and dividing the world
void check_tensor_parallel(int tensor_parallel, const hf::LlamaConfig& config);
// Checks --ep: >= 1 and dividing the data-parallel size (world / tp); and against the model:
// a mixture of experts whose num_experts it divides, without tensor parallelism (InputError
// naming the sizes). Call inside agree_on_inputs, after the --tp checks.
void check_expert_parallel_size(int expert_parallel, int tensor_parallel);
void check_expert_parallel(int expert_parallel, int tensor_parallel, const hf::LlamaConfig& config);
// The job's layout for --tp and --ep (collective; after the inputs are agreed on).
JobLayout make_layout(int tensor_parallel, int expert_parallel = 1);
// "4 rank(s) as dp 2 x tp 2", with ", ep 2 (experts: 2 per group of 4 ... )" under --ep.
std::string describe_layout(const JobLayout& layout);

// The token stream of a command (embedded corpus or a file), checked against the vocabulary.
// `default_split` applies to the embedded corpus when options.split is "auto".
// Text data (not the embedded corpus) goes through `tokenizer` when one is given.
TokenStream load_data(const ModelDataOptions& options, DataSplit default_split,
                      std::int64_t vocab_size, const hf::Tokenizer* tokenizer = nullptr);

// The windows `which` as an int64 tensor [which.size(), seq_len].
at::Tensor batch_of(const Windows& windows, const std::vector<std::int64_t>& which);
// `windows` (which must outlive the result) as the training library's SequenceSource: index i
// is window i, or with `order` the window at position i of the seeded epoch order.
train::SequenceSource sequence_source(const Windows& windows, std::string description,
                                      std::shared_ptr<WindowOrder> order = nullptr);

// load_data for `model`, plus the checks every command needs: at least one sequence of
// options.seq_len tokens, and seq_len within the model's max_position_embeddings.
TokenStream load_checked_data(const ModelDataOptions& options, DataSplit default_split,
                              const ModelChoice& model, const char* command);

// Creates `dir` if needed and proves it writable (a probe file is created and removed);
// InputError otherwise. Creates nothing when the path is not usable.
void check_writable_dir(const std::filesystem::path& dir, const char* what);
// Same for the directory that is to hold `file`.
void check_writable_file(const std::filesystem::path& file, const char* what);

// Peak resident set size of this process (VmHWM), MiB.
using train::peak_rss_mib;

// Threads for intra-op parallelism: OMP_NUM_THREADS when set (mdistrun sets 1 per rank for
// several ranks, as torchrun does), else libtorch's default.
void configure_threads();

// Prints on rank 0 (stdout, flushed).
void say(const std::string& line);

}  // namespace mdist::cli
