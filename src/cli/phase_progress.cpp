#include "src/cli/phase_progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace mdist::cli {

std::string phase_line(const PhaseReport& r) {
  std::string line = r.command + ": " + r.phase;
  if (r.total > 0) {
    line += " " + std::to_string(std::clamp<std::int64_t>(r.done, 0, r.total)) + "/" +
            std::to_string(r.total);
    if (!r.unit.empty()) line += " " + r.unit;
  }
  const auto s = std::isfinite(r.elapsed_s) && r.elapsed_s > 0
                     ? static_cast<long long>(std::floor(r.elapsed_s))
                     : 0LL;
  char time[48];
  if (s >= 3600) {
    std::snprintf(time, sizeof(time), " | %lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  } else {
    std::snprintf(time, sizeof(time), " | %lld:%02lld", s / 60, s % 60);
  }
  return line + time;
}

bool terminal_stdout() {
  const char* forced = std::getenv("MDIST_STDOUT_IS_TTY");
  return forced != nullptr ? std::strcmp(forced, "1") == 0 : isatty(fileno(stdout)) == 1;
}

PhaseProgress::PhaseProgress(std::FILE* out, std::string command, bool terminal)
    : out_(out), terminal_(terminal) {
  report_.command = std::move(command);
}

PhaseProgress::~PhaseProgress() {
  // An exception on the way out (an error line follows): only end the line, never throw.
  if (terminal_ && active_) {
    std::fputc('\n', out_);
    std::fflush(out_);
  }
}

void PhaseProgress::begin(std::string phase, std::int64_t total, std::string unit) {
  finish();
  report_.phase = std::move(phase);
  report_.total = total;
  report_.unit = std::move(unit);
  report_.done = 0;
  start_ = std::chrono::steady_clock::now();
  active_ = true;
  draw();
}

void PhaseProgress::update(std::int64_t done) {
  if (!active_) return;
  report_.done = done;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ < std::chrono::milliseconds(200) && done < report_.total) return;
  draw();
}

void PhaseProgress::finish() {
  if (!active_) return;
  draw();
  active_ = false;
  if (terminal_) {
    std::fputc('\n', out_);
    std::fflush(out_);
  }
}

void PhaseProgress::draw() {
  if (!terminal_) return;
  last_draw_ = std::chrono::steady_clock::now();
  report_.elapsed_s = std::chrono::duration<double>(last_draw_ - start_).count();
  // "\r" after the line, not before: the launcher's prefixer forwards a segment when it sees
  // the "\r" (see progress.cpp). ESC[K clears what a longer line left.
  std::fprintf(out_, "%s\x1b[K\r", phase_line(report_).c_str());
  std::fflush(out_);
}

}  // namespace mdist::cli
