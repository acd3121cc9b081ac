#include "src/cli/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace mdist::cli {
namespace {

std::string format(const char* fmt, auto... args) {
  char text[256];
  std::snprintf(text, sizeof(text), fmt, args...);
  return text;
}

std::string duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<long long>(std::llround(seconds));
  if (s >= 3600) return format("%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  return format("%lld:%02lld", s / 60, s % 60);
}

}  // namespace

std::string progress_line(const StepReport& r, bool with_bar) {
  std::string line = format("step %d/%d", r.step, r.total_steps);
  const double fraction = r.total_steps > 0 ? static_cast<double>(r.step) / r.total_steps : 1.0;
  if (with_bar) {
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(fraction * kWidth);
    line += " [" + std::string(static_cast<std::size_t>(filled), '#') +
            std::string(static_cast<std::size_t>(kWidth - filled), '.') + "]";
    line += format(" %3d%%", static_cast<int>(fraction * 100));
  }
  line += format(" | loss %.4f | lr %.2e | %.0f tok/s", r.loss, r.lr, r.tokens_per_s);
  const double per_step = r.steps_done_here > 0 ? r.elapsed_s / r.steps_done_here : 0;
  line += " | ETA " + duration(per_step * (r.total_steps - r.step));
  line += " | peak MiB";
  for (const double mib : r.peak_rss_mib) line += format(" %.0f", mib);
  return line;
}

Progress::Progress(std::FILE* out, int log_every) : out_(out), log_every_(std::max(1, log_every)) {
  const char* forced = std::getenv("MDIST_STDOUT_IS_TTY");
  terminal_ = forced != nullptr ? std::strcmp(forced, "1") == 0 : isatty(fileno(out)) == 1;
}

void Progress::update(const StepReport& report) {
  if (terminal_) {
    // "\r" after the line, not before: the launcher's prefixer forwards a segment when it sees
    // the "\r", so the bar on screen is never one update behind. ESC[K clears leftovers.
    std::fprintf(out_, "%s\x1b[K\r", progress_line(report, true).c_str());
    drawn_ = true;
  } else if (report.step % log_every_ == 0 || report.step == report.total_steps ||
             report.steps_done_here == 1) {
    std::fprintf(out_, "%s\n", progress_line(report, false).c_str());
  }
  std::fflush(out_);
}

void Progress::finish() {
  if (terminal_ && drawn_) {
    std::fputc('\n', out_);
    std::fflush(out_);
  }
  drawn_ = false;
}

void Progress::note(const std::string& text) {
  finish();
  std::fprintf(out_, "%s\n", text.c_str());
  std::fflush(out_);
}

}  // namespace mdist::cli
