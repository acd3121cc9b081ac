#include "mdist/train/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>
#include <vector>

#include "mdist/error.h"
#include "mdist/fsdp/state_dict.h"
#include "mdist/hf/expert_parallel.h"
#include "mdist/hf/pretrained.h"
#include "mdist/hf/safetensors.h"
#include "mdist/hf/tensor_parallel.h"
#include "mdist/io/atomic_file.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"

namespace mdist::train {
namespace {

namespace fs = std::filesystem;
// v3: besides the moments ("NAME/exp_avg", "NAME/exp_avg_sq", "NAME/max_exp_avg_sq" under
// amsgrad, each with metadata "row_offset,col_offset"), each parameter's own AdamW step count
// ("NAME/step", int64 [1]), as torch keeps `step` per parameter in optimizer.state_dict(); the
// metadata "no_state" lists (JSON) the parameters this file would have written but that have no
// optimizer state yet (no gradient so far: an expert no token chose), and "cpu_rng_state" the
// writing rank's generator. v2 (moments only, row and column offsets) and v1 (rows only) are
// still read: their parameters resume at the trainer's global step.
constexpr const char* kOptimizerFormat = "mdist.adamw.blocks.v3";
constexpr const char* kOptimizerFormatV2 = "mdist.adamw.blocks.v2";
constexpr const char* kOptimizerFormatV1 = "mdist.adamw.rows.v1";
constexpr const char* kMoments[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
// Between a moment's key and the number of a further row range of it (Block::full_rows).
constexpr char kPieceMark[] = "#";

std::string step_name(int step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step-%08d", step);
  return name;
}

std::string rank_file(int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof(name), "rank-%05d-of-%05d.safetensors", rank, world);
  return name;
}

std::string to_hex(const at::Tensor& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  const auto* data = bytes.data_ptr<uint8_t>();
  std::string hex;
  hex.reserve(static_cast<std::size_t>(bytes.numel()) * 2);
  for (int64_t i = 0; i < bytes.numel(); ++i) {
    hex.push_back(kDigits[data[i] >> 4]);
    hex.push_back(kDigits[data[i] & 15]);
  }
  return hex;
}

at::Tensor from_hex(const std::string& hex) {
  auto bytes = torch::empty({static_cast<int64_t>(hex.size() / 2)}, torch::kUInt8);
  auto* data = bytes.data_ptr<uint8_t>();
  const auto digit = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) {
    data[i / 2] = static_cast<uint8_t>(digit(hex[i]) * 16 + digit(hex[i + 1]));
  }
  return bytes;
}

std::string cpu_rng_state() {
  auto generator = at::detail::getDefaultCPUGenerator();
  const std::lock_guard<std::mutex> lock(generator.mutex());
  return to_hex(generator.get_state());
}

void set_cpu_rng_state(const std::string& hex) {
  if (hex.empty()) return;
  auto generator = at::detail::getDefaultCPUGenerator();
  const std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(from_hex(hex));
}

torch::optim::AdamWParamState* adamw_state(torch::optim::Optimizer& optimizer,
                                           const at::Tensor& param) {
  auto& states = optimizer.state();
  const auto it = states.find(param.unsafeGetTensorImpl());
  if (it == states.end()) return nullptr;
  return dynamic_cast<torch::optim::AdamWParamState*>(it->second.get());
}

// Rows [0, rows) of a moment (a shard's padding rows are not saved), as a contiguous tensor.
at::Tensor owned(const at::Tensor& moment, int64_t rows) {
  if (moment.dim() == 0) return moment.reshape({1}).contiguous();
  return moment.narrow(0, 0, rows).contiguous();
}

// Where this rank's part of a parameter lies in the full HF-layout tensor: rows
// [row_offset, row_offset + rows) and, for a weight split by columns over the tensor-parallel
// group, columns from col_offset (its local width); and whether this rank writes it (it holds
// the first copy: every rank holding rows of a shard, for a whole parameter the first rank
// holding it, and among tensor-parallel replicas the primary).
struct Block {
  int64_t row_offset = 0;
  int64_t rows = 0;
  int64_t col_offset = 0;
  bool writes = false;
  // The full tensor's row ranges of local rows [0, rows), in order: one ([row_offset, +rows))
  // but for a fused weight split as several row ranges (Phi-3's qkv_proj under --tp), whose
  // rows are written as one piece per range ("NAME/exp_avg", "NAME/exp_avg#1", ...).
  std::vector<tp::RowRange> full_rows;
};

// Which ranks hold the first copy of a whole parameter: data-parallel rank 0, or for an
// expert split by expert parallelism the first rank of its expert-data-parallel group (the
// experts are not on every data-parallel rank).
class FirstCopies {
 public:
  FirstCopies(hf::CausalLM& model, const hf::Parallelism& parallelism,
              const ParallelState& parallel)
      : dp_first_(mdist::rank(parallel.data_parallel_group.group()) <= 0),
        split_experts_(hf::split_expert_parameters(model, parallelism.expert_parallel,
                                                   parallel.data_parallel_group.group())) {}
  bool holds(const std::string& name) const {
    const auto it = split_experts_.find(name);
    return it != split_experts_.end() ? it->second : dp_first_;
  }

 private:
  bool dp_first_;
  std::map<std::string, bool> split_experts_;  // by name: whether this rank is their first
};

Block block_of(const std::string& name, const ParamPlacement& place,
               const hf::Parallelism& parallelism, const FirstCopies& first_copies) {
  Block block{place.row_offset, place.rows, 0, false, {}};
  bool primary = true;
  if (parallelism.tensor_parallel_split()) {
    const auto& plan = parallelism.tensor_parallel;
    const auto tp = plan->placement(name);
    primary = tp.primary;
    using Split = hf::TensorParallelPlacement::Split;
    if (tp.split == Split::kRows) {
      block.full_rows = tp.full_rows_of(place.row_offset, place.rows);
      block.row_offset = block.full_rows.empty() ? 0 : block.full_rows.front().first;
    }
    if (tp.split == Split::kColumns) block.col_offset = tp.offset;
  }
  if (block.full_rows.empty() && place.rows > 0) {
    block.full_rows.push_back({block.row_offset, place.rows});
  }
  block.writes = place.rows > 0 && primary && (place.sharded || first_copies.holds(name));
  return block;
}

void write_optimizer_rows(const fs::path& file, hf::CausalLM& model,
                          const hf::Parallelism& parallelism, torch::optim::Optimizer& optimizer,
                          const ParallelState& parallel) {
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> metadata{{"format", kOptimizerFormat},
                                              {"cpu_rng_state", cpu_rng_state()}};
  auto no_state = nlohmann::json::array();
  const FirstCopies first_copies(model, parallelism, parallel);
  for (const auto& [name, place] : param_placements(*model)) {
    const Block block = block_of(name, place, parallelism, first_copies);
    if (!block.writes) continue;
    const auto* state = adamw_state(optimizer, place.param);
    if (state == nullptr) {
      // Written down rather than left out, so that the loader tells a parameter that has no
      // state yet from one whose state is missing.
      no_state.push_back(name);
      continue;
    }
    const at::Tensor moments[] = {state->exp_avg(), state->exp_avg_sq(), state->max_exp_avg_sq()};
    for (std::size_t i = 0; i < std::size(kMoments); ++i) {
      if (!moments[i].defined() || (i == 2 && moments[i].numel() == 0)) continue;
      const at::Tensor rows = owned(moments[i], place.rows).to(torch::kCPU);
      int64_t local = 0;
      for (std::size_t j = 0; j < block.full_rows.size(); ++j) {
        const tp::RowRange& range = block.full_rows[j];
        const std::string key =
            name + "/" + kMoments[i] + (j == 0 ? "" : kPieceMark + std::to_string(j));
        tensors[key] = rows.dim() == 0 || block.full_rows.size() == 1
                           ? rows
                           : rows.narrow(0, local, range.count).contiguous();
        metadata[key] = std::to_string(range.first) + "," + std::to_string(block.col_offset);
        local += range.count;
      }
    }
    tensors[name + "/step"] = torch::full({1}, state->step(), torch::kLong);
    metadata[name + "/step"] = "0,0";
  }
  metadata["no_state"] = no_state.dump();
  hf::save_safetensors(file, tensors, metadata);
}

// Every rank's rows of every moment, from all the optimizer files of a checkpoint.
class OptimizerRows {
 public:
  explicit OptimizerRows(const fs::path& dir) {
    std::error_code ec;
    std::vector<fs::path> paths;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      if (entry.path().extension() == ".safetensors") paths.push_back(entry.path());
    }
    std::sort(paths.begin(), paths.end());
    for (const auto& path : paths) {
      try {
        files_.push_back(std::make_unique<hf::SafetensorsFile>(path));
      } catch (const Error& error) {
        throw InputError("optimizer state file '" + path.string() + "': " + error.what());
      }
      const auto& file = *files_.back();
      const auto format = file.metadata().find("format");
      if (format == file.metadata().end() ||
          (format->second != kOptimizerFormat && format->second != kOptimizerFormatV2 &&
           format->second != kOptimizerFormatV1)) {
        throw InputError("'" + path.string() + "' is not an mdist optimizer state file");
      }
      const bool v3 = format->second == kOptimizerFormat;
      if (!paths_.empty() && v3 != per_parameter_steps_) {
        throw InputError("'" + path.string() + "' is of another format (" + format->second +
                         ") than the checkpoint's other optimizer state files");
      }
      per_parameter_steps_ = v3;
      paths_.push_back(path);
      if (const auto listed = file.metadata().find("no_state"); listed != file.metadata().end()) {
        const auto names = nlohmann::json::parse(listed->second, nullptr, false);
        if (!names.is_array()) {
          throw InputError("'" + path.string() + "': \"no_state\" is not a JSON list of names");
        }
        for (const auto& name : names) {
          if (!name.is_string()) {
            throw InputError("'" + path.string() + "': \"no_state\" holds a non-name");
          }
          no_state_.insert(name.get<std::string>());
        }
      }
      if (const auto rng = file.metadata().find("cpu_rng_state"); rng != file.metadata().end()) {
        rng_states_[path.filename().string()] = rng->second;
      }
      for (const auto& key : file.names()) {
        if (key.ends_with("/step")) {
          read_step(file, key);
          continue;
        }
        const auto offset = file.metadata().find(key);
        if (offset == file.metadata().end()) {
          throw InputError("'" + path.string() + "' has no row offset for '" + key + "'");
        }
        const auto shape = file.info(key).shape;
        Piece piece{&file, 0, shape.at(0), 0, shape.size() >= 2 ? shape[1] : 1, key};
        if (std::sscanf(offset->second.c_str(), "%" SCNd64 ",%" SCNd64, &piece.offset,
                        &piece.col_offset) < 1) {
          throw InputError("'" + path.string() + "': bad offset '" + offset->second + "' for '" +
                           key + "'");
        }
        // A fused weight's further row ranges are pieces of the same moment.
        pieces_[key.substr(0, key.find(kPieceMark))].push_back(piece);
      }
    }
  }

  bool empty() const { return pieces_.empty() && no_state_.empty(); }
  // Whether the files keep each parameter's own AdamW step (v3); else every parameter resumes
  // at the trainer's step.
  bool per_parameter_steps() const { return per_parameter_steps_; }
  const std::vector<fs::path>& paths() const { return paths_; }
  // Whether `name` has optimizer state in the checkpoint (its first moment is there).
  bool has_state(const std::string& name) const { return pieces_.contains(name + "/exp_avg"); }
  bool has(const std::string& key) const { return pieces_.contains(key); }
  // Whether a writer listed `name` as having no optimizer state. A v1/v2 writer left such a
  // parameter out without saying so: there, a parameter with no moments at all counts as one.
  bool listed_without_state(const std::string& name) const {
    return per_parameter_steps_ ? no_state_.contains(name) : !has_state(name);
  }
  // `name`'s own step (v3 only; InputError when a parameter with moments has none).
  int64_t step(const std::string& name) const {
    const auto it = steps_.find(name);
    if (it == steps_.end()) throw InputError("optimizer state has no '" + name + "/step'");
    return it->second;
  }
  // The generator state saved by the writer of `file_name` (v3), if any.
  std::optional<std::string> rng_state(const std::string& file_name) const {
    const auto it = rng_states_.find(file_name);
    return it == rng_states_.end() ? std::nullopt : std::optional(it->second);
  }

  // Checks that the pieces of `key` lie inside `shape` (its full HF-layout shape), are float32
  // and cover it once.
  void check(const std::string& key, c10::IntArrayRef shape) const {
    const auto it = pieces_.find(key);
    if (it == pieces_.end()) throw InputError("optimizer state has no '" + key + "'");
    const int64_t rows = shape.empty() ? 1 : shape[0];
    const int64_t cols = shape.size() >= 2 ? shape[1] : 1;
    const int64_t row_numel =
        shape.empty() ? 1 : c10::multiply_integers(shape) / std::max<int64_t>(rows, 1);
    int64_t covered = 0;
    for (const auto& piece : it->second) {
      const auto& info = piece.file->info(piece.key);
      const int64_t piece_row_numel = info.shape.empty() ? 1
                                                         : c10::multiply_integers(info.shape) /
                                                               std::max<int64_t>(info.shape[0], 1);
      const bool inside = piece.offset >= 0 && piece.offset + piece.rows <= rows &&
                          piece.col_offset >= 0 &&
                          (shape.size() < 2 ? piece_row_numel == row_numel
                                            : piece.col_offset + piece.cols <= cols &&
                                                  piece_row_numel * cols == row_numel * piece.cols);
      if (info.dtype != at::kFloat || !inside) {
        throw InputError("optimizer state file '" + piece.file->path().string() + "': '" + key +
                         "' (" + hf::dtype_name(info.dtype) + " of " + std::to_string(piece.rows) +
                         " rows from row " + std::to_string(piece.offset) +
                         ") does not fit the parameter's float32 shape");
      }
      covered += piece.rows * (shape.size() >= 2 ? piece.cols : 1);
    }
    if (covered != rows * cols) {
      throw InputError("optimizer state for '" + key + "' covers " + std::to_string(covered) +
                       " of its " + std::to_string(rows * cols) + " rows x columns");
    }
  }

  // Rows [first, first + rows) and (for a tensor of 2 or more dimensions) columns
  // [col_first, col_first + target.size(1)) of `key` into target's first `rows` rows, from
  // whichever pieces cover them.
  void read(const std::string& key, int64_t first, int64_t rows, int64_t col_first,
            at::Tensor target) const {
    const auto it = pieces_.find(key);
    if (it == pieces_.end()) throw InputError("optimizer state has no '" + key + "'");
    const bool columns = target.dim() >= 2;
    const int64_t cols = columns ? target.size(1) : 1;
    int64_t covered = 0;
    for (const auto& piece : it->second) {
      const int64_t lo = std::max(first, piece.offset);
      const int64_t hi = std::min(first + rows, piece.offset + piece.rows);
      const int64_t clo = columns ? std::max(col_first, piece.col_offset) : 0;
      const int64_t chi = columns ? std::min(col_first + cols, piece.col_offset + piece.cols) : 1;
      if (lo >= hi || clo >= chi) continue;
      at::Tensor source = piece.file->read_rows(piece.key, lo - piece.offset, hi - lo);
      at::Tensor into = target.narrow(0, lo - first, hi - lo);
      if (columns) {
        source = source.narrow(1, clo - piece.col_offset, chi - clo);
        into = into.narrow(1, clo - col_first, chi - clo);
      }
      into.copy_(source.reshape(into.sizes()));
      covered += (hi - lo) * (chi - clo);
    }
    if (covered != rows * cols) {
      throw InputError("optimizer state for '" + key + "' covers " + std::to_string(covered) +
                       " of the " + std::to_string(rows * cols) + " elements needed");
    }
  }

 private:
  struct Piece {
    const hf::SafetensorsFile* file;
    int64_t offset;  // first row
    int64_t rows;
    int64_t col_offset;
    int64_t cols;
    std::string key;  // in the file (a further row range's has its number: "...#1")
  };
  // A parameter's step, written by each rank holding a first copy of part of it: the copies
  // must agree.
  void read_step(const hf::SafetensorsFile& file, const std::string& key) {
    const auto& info = file.info(key);
    if (info.dtype != at::kLong || c10::multiply_integers(info.shape) != 1) {
      throw InputError("optimizer state file '" + file.path().string() + "': '" + key +
                       "' is not one int64 step count");
    }
    const int64_t value = file.tensor(key).reshape({}).item<int64_t>();
    const std::string name = key.substr(0, key.size() - std::string_view("/step").size());
    if (value < 0) {
      throw InputError("optimizer state file '" + file.path().string() + "': '" + key +
                       "' is negative (" + std::to_string(value) + ")");
    }
    const auto [it, inserted] = steps_.emplace(name, value);
    if (!inserted && it->second != value) {
      throw InputError("optimizer state files disagree on '" + key + "' (" +
                       std::to_string(it->second) + " and " + std::to_string(value) + " in '" +
                       file.path().string() + "')");
    }
  }

  std::vector<std::unique_ptr<hf::SafetensorsFile>> files_;
  std::vector<fs::path> paths_;
  std::map<std::string, std::vector<Piece>> pieces_;
  std::map<std::string, int64_t> steps_;
  std::set<std::string> no_state_;
  std::map<std::string, std::string> rng_states_;  // by file name
  bool per_parameter_steps_ = false;
};

void replace_directory(const fs::path& from, const fs::path& to) {
  const fs::path old = to.parent_path() / ("." + to.filename().string() + ".old");
  std::error_code ec;
  fs::remove_all(old, ec);
  if (fs::exists(to)) fs::rename(to, old);
  fs::rename(from, to);
  io::sync_directory(to.parent_path());  // the new step directory survives a power loss
  fs::remove_all(old, ec);
}

// Removes a step directory, renamed to a hidden name first, so that a crash mid-removal never
// leaves a visible, partial step directory (which resume_point would take for damage).
void remove_hidden(const fs::path& dir, const fs::path& step) {
  std::error_code ec;
  const fs::path hidden = dir / (".old-" + step.filename().string());
  fs::remove_all(hidden, ec);
  fs::rename(step, hidden, ec);
  fs::remove_all(ec ? step : hidden, ec);
}

// Keeps the newest `keep` checkpoints up to `current`. Checkpoints of a later step belong to
// an earlier run in the same directory that this (fresh) run replaces: they go too, so that
// "newest" always means this run's.
void prune(const fs::path& dir, const std::string& current, int keep) {
  std::vector<fs::path> steps, later;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const auto name = entry.path().filename().string();
    if (!entry.is_directory() || name.rfind("step-", 0) != 0) continue;
    if (name > current) {
      later.push_back(entry.path());
    } else {
      steps.push_back(entry.path());
    }
  }
  for (const auto& step : later) remove_hidden(dir, step);
  std::sort(steps.begin(), steps.end());
  const auto excess = static_cast<std::ptrdiff_t>(steps.size()) - std::max(1, keep);
  for (std::ptrdiff_t i = 0; i < excess; ++i) {
    remove_hidden(dir, steps[static_cast<std::size_t>(i)]);
  }
}

}  // namespace

void save_training_checkpoint(const fs::path& run_dir, hf::CausalLM& model,
                              const hf::Parallelism& parallelism,
                              torch::optim::Optimizer& optimizer, const TrainerState& state,
                              int keep, const ParallelState& parallel,
                              const std::vector<fs::path>& carried) {
  const fs::path dir = run_dir / "checkpoints";
  const std::string name = step_name(state.step);
  const fs::path tmp = dir / (".tmp-" + name);
  // A rank that fails to write (a full disk, a quota) must not leave the others waiting or a
  // partial hidden directory behind: each part is attempted, the outcomes agreed on, and on
  // any failure the temporary directory goes and the previous checkpoint stays `latest`.
  std::optional<std::string> failure;
  const auto attempt = [&](const std::function<void()>& part) {
    if (failure) return;
    try {
      part();
    } catch (const std::exception& error) {
      failure = error.what();
    }
  };
  const auto agree = [&] {
    std::optional<std::string> first;
    for (const auto& f : allgather(failure)) {
      if (f && !first) first = f;
    }
    if (!first) return;
    if (rank() == 0) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
    throw AgreedError("cannot write checkpoint " + (dir / name).string() + ": " +
                      first->substr(0, first->find('\n')) +
                      (latest_checkpoint(run_dir) ? "; the previous checkpoint is kept" : ""));
  };
  if (rank() == 0) {
    attempt([&] {
      fs::remove_all(tmp);
      fs::create_directories(tmp / "optimizer");
    });
  }
  agree();
  // save_pretrained gathers (collectively) before rank 0 writes, so every rank calls it.
  attempt([&] { hf::save_pretrained(model, parallelism, tmp); });
  attempt([&] {
    write_optimizer_rows(tmp / "optimizer" / rank_file(rank(), size()), model, parallelism,
                         optimizer, parallel);
  });
  if (rank() == 0)
    attempt([&] {
      const nlohmann::json trainer = {
          {"format", "mdist.trainer_state.v1"},
          {"step", state.step},
          {"sequences_seen", state.sequences_seen},
          {"world_size", size()},
          {"tensor_parallel", std::max(1, parallel.tensor_parallel_group.world_size())},
          {"run", state.run},
          {"cpu_rng_state", cpu_rng_state()},
          {"skipped_steps", state.skipped_steps},
      };
      io::write_file_atomically(tmp / "trainer_state.json", trainer.dump(2) + "\n");
      // Written through io (fsynced) like every other file of the checkpoint, so that a
      // checkpoint that looks complete after a power loss holds whole tokenizer files too.
      for (const auto& file : carried) {
        std::ifstream in(file, std::ios::binary);
        const std::string bytes((std::istreambuf_iterator<char>(in)), {});
        if (!in && !in.eof()) throw Error("cannot read '" + file.string() + "'");
        io::write_file_atomically(tmp / file.filename(), bytes);
      }
    });
  agree();  // every rank's files are complete
  if (rank() == 0) {
    replace_directory(tmp, dir / name);
    io::write_file_atomically(dir / "latest", name + "\n");
    prune(dir, name, keep);
  }
  barrier();
}

std::optional<fs::path> latest_checkpoint(const fs::path& run_dir) {
  const fs::path dir = run_dir / "checkpoints";
  std::error_code ec;
  std::ifstream latest(dir / "latest");
  std::string name;
  if (latest && std::getline(latest, name) && !name.empty() &&
      fs::exists(dir / name / "trainer_state.json", ec)) {
    return dir / name;
  }
  // No (or a stale) pointer: the newest complete step directory.
  std::optional<fs::path> newest;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const auto file = entry.path().filename().string();
    if (file.rfind("step-", 0) == 0 && fs::exists(entry.path() / "trainer_state.json", ec) &&
        (!newest || entry.path() > *newest)) {
      newest = entry.path();
    }
  }
  return newest;
}

ResumePoint resume_point(const fs::path& run_dir) {
  const fs::path dir = run_dir / "checkpoints";
  ResumePoint point;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return point;
  // What a save leaves: a hidden .tmp-step-N while it writes (renamed into place only when
  // complete), then `latest` rewritten. So a visible step directory without trainer_state.json,
  // or a `latest` naming a directory that is not there, is damage, not an interrupted save.
  std::vector<std::string> steps, interrupted;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const auto name = entry.path().filename().string();
    if (!entry.is_directory(ec)) continue;
    if (name.rfind("step-", 0) == 0) steps.push_back(name);
    if (name.rfind(".tmp-step-", 0) == 0) interrupted.push_back(name.substr(5));
  }
  std::sort(steps.begin(), steps.end());
  const auto complete = [&](const std::string& name) {
    return fs::is_regular_file(dir / name / "trainer_state.json", ec);
  };
  std::optional<std::string> pointer;
  if (std::ifstream latest(dir / "latest"); latest) {
    std::string name;
    std::getline(latest, name);
    if (name.empty() || name.find('/') != std::string::npos || name.rfind("step-", 0) != 0) {
      throw InputError("'" + (dir / "latest").string() + "' does not name a step directory (\"" +
                       name.substr(0, 64) + "\")");
    }
    pointer = name;
  }
  const auto newest_complete = [&]() -> std::optional<std::string> {
    for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
      if (complete(*it)) return *it;
    }
    return std::nullopt;
  }();
  const std::string fix = "; to continue from an earlier checkpoint, write its name into " +
                          (dir / "latest").string() + " (the newest complete one is " +
                          newest_complete.value_or("none") + ")";
  if (pointer && !fs::is_directory(dir / *pointer, ec)) {
    throw InputError("'" + (dir / "latest").string() + "' names " + *pointer +
                     ", which does not exist (removed or damaged)" + fix);
  }
  // The newest step directory must be a complete checkpoint: anything else is damage, and
  // falling back to an older one would silently throw away training.
  if (!steps.empty() && !complete(steps.back())) {
    throw InputError("checkpoint '" + (dir / steps.back()).string() +
                     "' is damaged (no trainer_state.json)" + fix);
  }
  if (pointer && !complete(*pointer)) {
    throw InputError("checkpoint '" + (dir / *pointer).string() +
                     "', named by checkpoints/latest, is damaged (no trainer_state.json)" + fix);
  }
  const std::optional<std::string> chosen = pointer ? pointer : newest_complete;
  if (!chosen) return point;
  point.checkpoint = dir / *chosen;
  if (!pointer) {
    point.warnings.push_back("'" + (dir / "latest").string() + "' is missing (a save interrupted " +
                             "before it was written); using the newest complete checkpoint " +
                             *chosen);
  } else if (newest_complete && *newest_complete > *pointer) {
    point.warnings.push_back("checkpoints/latest names " + *pointer + "; the newer " +
                             *newest_complete + " is not used (latest set back by hand, or a " +
                             "save interrupted before it updated latest)");
  }
  for (const auto& name : interrupted) {
    if (name > *chosen) {
      point.warnings.push_back("an interrupted save of " + name + " (checkpoints/.tmp-" + name +
                               ") is ignored: the steps after " + *chosen + " are trained again");
    }
  }
  return point;
}

TrainerState read_trainer_state(const fs::path& checkpoint) {
  const fs::path path = checkpoint / "trainer_state.json";
  std::ifstream in(path);
  if (!in) throw InputError("checkpoint '" + checkpoint.string() + "' has no trainer_state.json");
  const auto json = nlohmann::json::parse(in, nullptr, false);
  const auto bad = [&](const std::string& what) {
    return InputError("'" + path.string() + "': " + what);
  };
  if (!json.is_object() || json.value("format", "") != "mdist.trainer_state.v1") {
    throw bad(
        "not an mdist trainer state (malformed JSON or no \"format\": "
        "\"mdist.trainer_state.v1\")");
  }
  TrainerState state;
  int world = 1, tp = 1;
  try {
    state.step = json.at("step").get<int>();
    state.sequences_seen = json.at("sequences_seen").get<int64_t>();
    state.run = json.value("run", nlohmann::json::object());
    state.rng_state_hex = json.value("cpu_rng_state", "");
    state.skipped_steps = json.value("skipped_steps", 0);
    world = json.value("world_size", 1);
    tp = json.value("tensor_parallel", 1);
    if (!state.run.is_object()) throw bad("\"run\" is not an object");
  } catch (const nlohmann::json::exception& error) {
    throw bad(std::string("a field is missing or of the wrong type (") + error.what() + ")");
  }
  if (state.step < 1) throw bad("step " + std::to_string(state.step) + " is not a step (>= 1)");
  if (const auto name = checkpoint.filename().string();
      name.rfind("step-", 0) == 0 && name != step_name(state.step)) {
    throw bad("step " + std::to_string(state.step) + " is not the directory's (" + name + ")");
  }
  if (state.run.contains("steps") && state.run["steps"].is_number_integer() &&
      state.step > state.run["steps"].get<int>()) {
    throw bad("step " + std::to_string(state.step) + " is beyond the run's steps " +
              state.run["steps"].dump());
  }
  if (state.run.contains("global_batch") && state.run["global_batch"].is_number_integer() &&
      state.sequences_seen != state.step * state.run["global_batch"].get<int64_t>()) {
    throw bad("sequences_seen " + std::to_string(state.sequences_seen) + " is not step " +
              std::to_string(state.step) + " x global_batch " + state.run["global_batch"].dump());
  }
  if (state.skipped_steps < 0 || state.skipped_steps > state.step) {
    throw bad("skipped_steps " + std::to_string(state.skipped_steps) + " is outside [0, step]");
  }
  if (world < 1 || tp < 1 || world % tp != 0) {
    throw bad("world_size " + std::to_string(world) + " and tensor_parallel " + std::to_string(tp) +
              " are not a layout (both >= 1, tensor_parallel dividing)");
  }
  if (!state.rng_state_hex.empty()) {
    const bool hex = state.rng_state_hex.find_first_not_of("0123456789abcdef") == std::string::npos;
    if (!hex || state.rng_state_hex.size() != cpu_rng_state().size()) {
      throw bad("cpu_rng_state is not a state of this libtorch's CPU generator (" +
                std::to_string(cpu_rng_state().size()) + " hex digits expected, got " +
                std::to_string(state.rng_state_hex.size()) + (hex ? "" : ", not all hex") + ")");
    }
  }
  return state;
}

OptimizerStateCheck check_optimizer_state(const fs::path& checkpoint, const hf::LlamaConfig& config,
                                          int step) {
  const fs::path dir = checkpoint / "optimizer";
  const OptimizerRows rows(dir);
  const auto bad = [&](const std::string& what) {
    return InputError("checkpoint '" + checkpoint.string() + "': " + what);
  };
  if (rows.empty()) {
    if (step > 0) throw bad("has no optimizer state");
    return {};
  }
  // Every writing rank's file: a lost one would leave some parameters partly covered, or (for
  // a rank holding whole parameters alone) without state as if they had none.
  int world = -1;
  std::set<int> ranks;
  for (const auto& path : rows.paths()) {
    int r = -1, w = -1;
    char tail = 0;
    if (std::sscanf(path.filename().c_str(), "rank-%d-of-%d.safetensor%c", &r, &w, &tail) != 3 ||
        path.filename() != rank_file(r, w) || (world != -1 && w != world)) {
      throw bad("optimizer/" + path.filename().string() +
                " is not one of the rank files rank-RRRRR-of-WWWWW.safetensors of one world size");
    }
    world = w;
    ranks.insert(r);
  }
  for (int r = 0; r < world; ++r) {
    if (!ranks.contains(r)) {
      throw bad("optimizer/" + rank_file(r, world) + " is missing (the checkpoint is incomplete)");
    }
  }
  const hf::CausalLM meta(config, c10::kMeta);
  for (const auto& item : meta->named_parameters()) {
    const std::string& name = item.key();
    try {
      if (rows.has_state(name)) {
        for (const char* kind : kMoments) {
          const std::string key = name + "/" + kind;
          // amsgrad's maximum is there for every parameter with state, or for none.
          if (std::string_view(kind) == "max_exp_avg_sq" && !rows.has(key)) continue;
          rows.check(key, item.value().sizes());
        }
        if (rows.per_parameter_steps()) (void)rows.step(name);
      } else if (!rows.listed_without_state(name)) {
        throw InputError("optimizer state has no '" + name +
                         "/exp_avg' and does not list the parameter as one without state");
      }
    } catch (const InputError& error) {
      throw bad(error.what());
    }
  }
  return {.per_parameter_steps = rows.per_parameter_steps(), .world_size = world};
}

void load_training_checkpoint(const fs::path& checkpoint, hf::CausalLM& model,
                              const hf::Parallelism& parallelism,
                              torch::optim::Optimizer& optimizer, const TrainerState& state,
                              const ParallelState& parallel) {
  const OptimizerRows rows(checkpoint / "optimizer");
  if (rows.empty() && state.step > 0) {
    throw InputError("checkpoint '" + checkpoint.string() + "' has no optimizer state");
  }
  const torch::NoGradGuard no_grad;
  const FirstCopies first_copies(model, parallelism, parallel);
  for (const auto& [name, place] : param_placements(*model)) {
    auto* key = place.param.unsafeGetTensorImpl();
    if (!rows.has_state(name)) {
      // As torch's AdamW loading a state dict without an entry for the parameter: it gets its
      // state (step 0, zero moments) at its first gradient.
      optimizer.state().erase(key);
      continue;
    }
    auto fresh = std::make_unique<torch::optim::AdamWParamState>();
    fresh->step(rows.per_parameter_steps() ? rows.step(name) : state.step);
    const Block block = block_of(name, place, parallelism, first_copies);
    const auto target = [](at::Tensor& t) { return t.dim() == 0 ? t.view({1}) : t; };
    const auto read = [&](const char* kind) {
      auto moment = torch::zeros_like(place.param, at::MemoryFormat::Contiguous);
      if (place.rows > 0) {
        int64_t local = 0;
        for (const tp::RowRange& range : block.full_rows) {
          at::Tensor into = target(moment);
          if (block.full_rows.size() > 1) into = into.narrow(0, local, range.count);
          rows.read(name + "/" + kind, range.first, range.count, block.col_offset, into);
          local += range.count;
        }
      }
      return moment;
    };
    fresh->exp_avg(read("exp_avg"));
    fresh->exp_avg_sq(read("exp_avg_sq"));
    if (rows.has(name + "/max_exp_avg_sq")) fresh->max_exp_avg_sq(read("max_exp_avg_sq"));
    optimizer.state()[key] = std::move(fresh);
  }
  // Each rank's own generator when the world is the one that wrote the checkpoint; else (or
  // for an older checkpoint) rank 0's, from trainer_state.json.
  const auto own = rows.rng_state(rank_file(rank(), size()));
  const bool usable = own && own->size() == cpu_rng_state().size() &&
                      own->find_first_not_of("0123456789abcdef") == std::string::npos;
  set_cpu_rng_state(usable ? *own : state.rng_state_hex);
}

}  // namespace mdist::train
