// See mdist/train/metrics.h.
#include "mdist/train/metrics.h"

#include <cmath>
#include <string>

#include "mdist/io/atomic_file.h"

namespace mdist::train {
namespace {

namespace fs = std::filesystem;

nlohmann::json finite_or_null(double value) {
  return std::isfinite(value) ? nlohmann::json(value) : nlohmann::json(nullptr);
}

// The lines of `path` up to step `step`.
std::string lines_up_to(const fs::path& path, int step) {
  std::string kept;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto json = nlohmann::json::parse(line, nullptr, false);
    if (json.is_object() && json.value("step", 0) <= step) kept += line + "\n";
  }
  return kept;
}

}  // namespace

MetricsWriter::MetricsWriter(fs::path path, std::optional<int> keep_up_to)
    : path_(std::move(path)) {
  io::write_file_atomically(path_, keep_up_to ? lines_up_to(path_, *keep_up_to) : std::string());
  out_.open(path_, std::ios::app);
}

void MetricsWriter::write(const nlohmann::json& line) { out_ << line.dump() << '\n' << std::flush; }

nlohmann::json step_metrics(const StepStats& stats, const StepMetricsFields& fields,
                            int skipped_steps) {
  nlohmann::json line = {
      {"step", stats.step},
      {"loss", finite_or_null(stats.loss)},
      {"lr", stats.lr},
      {"tokens_per_s", stats.tokens_per_s},
      {"step_time_s", stats.step_time_s},
      {"grad_norm", finite_or_null(stats.grad_norm)},
      {"peak_rss_mib", stats.peak_rss_mib},
  };
  if (fields.aux_loss) {
    line["aux_loss"] = finite_or_null(stats.aux_loss);
    line["router_aux_loss_coef"] = fields.aux_loss_weight;
    if (fields.all_to_all_bytes) line["all_to_all_bytes"] = stats.all_to_all_bytes;
  }
  if (fields.distillation) {
    line["kd_loss"] = finite_or_null(stats.kd_loss);
    line["cross_entropy"] = finite_or_null(stats.cross_entropy);
  }
  if (fields.skipped) {
    line["skipped"] = stats.skipped;
    line["skipped_steps"] = skipped_steps;
  }
  return line;
}

nlohmann::json eval_metrics(int step, const HeldOutLoss& held) {
  return {{"step", step},
          {"eval_loss", held.mean()},
          {"eval_perplexity", std::exp(held.mean())},
          {"eval_tokens", held.tokens}};
}

std::vector<std::pair<int, double>> metric_points(const fs::path& metrics, const char* key) {
  std::vector<std::pair<int, double>> points;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto json = nlohmann::json::parse(line, nullptr, false);
    if (json.is_object() && json.contains(key) && json[key].is_number()) {
      points.emplace_back(json.value("step", 0), json[key].get<double>());
    }
  }
  return points;
}

}  // namespace mdist::train
