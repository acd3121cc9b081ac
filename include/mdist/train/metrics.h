#pragma once
// A run's metrics.jsonl: one JSON object per line (a step's statistics, a held-out loss), written
// by rank 0 and flushed per line, so that a crash loses at most the line being written.
#include <filesystem>
#include <fstream>
#include <optional>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "mdist/train/evaluate.h"
#include "mdist/train/trainer.h"

namespace mdist::train {

class MetricsWriter {
 public:
  // A fresh run (keep_up_to nullopt) starts the file empty; a resumed one keeps the lines of
  // the steps up to its checkpoint's and drops the later ones (written after the checkpoint by
  // the interrupted run). Either is an atomic replacement of the file, then lines are appended.
  MetricsWriter(std::filesystem::path path, std::optional<int> keep_up_to);
  void write(const nlohmann::json& line);
  void close() { out_.close(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::ofstream out_;
};

// Which of a step's optional statistics its line carries.
struct StepMetricsFields {
  bool aux_loss = false;          // a mixture of experts: aux_loss and router_aux_loss_coef
  double aux_loss_weight = 0;     // the weight in the objective (0: not in it)
  bool all_to_all_bytes = false;  // expert parallelism
  bool skipped = false;           // --skip-nonfinite-steps: skipped and skipped_steps
  bool distillation = false;      // a teacher: kd_loss and cross_entropy (`loss` is KD + W x CE)
};

// A step's line: step, loss, lr, tokens_per_s, step_time_s, grad_norm, peak_rss_mib (per rank)
// and the optional fields; JSON has no NaN or infinity, so a non-finite value is null.
nlohmann::json step_metrics(const StepStats& stats, const StepMetricsFields& fields,
                            int skipped_steps);
// A held-out evaluation's line: step, eval_loss, eval_perplexity, eval_tokens.
nlohmann::json eval_metrics(int step, const HeldOutLoss& held);

// (step, value of `key`) of every line of a metrics file with a numeric `key` (a skipped
// step's null loss is left out).
std::vector<std::pair<int, double>> metric_points(const std::filesystem::path& metrics,
                                                  const char* key);

}  // namespace mdist::train
