#pragma once
// Rank 0's view of a command that runs in phases (quantize: held-out loss, calibration,
// SmoothQuant's second pass, export): on a terminal one line per phase, redrawn in place with
// a count and the phase's elapsed time, and left on screen when the phase ends; otherwise (a
// pipe, a log file, CI, or a rank other than 0) nothing, so logs keep only the command's own
// lines. Under mdistrun a rank's stdout is a pipe, so the launcher tells the ranks through
// MDIST_STDOUT_IS_TTY whether its own stdout is a terminal (see progress.h).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace mdist::cli {

struct PhaseReport {
  std::string command;  // "mdist quantize"
  std::string phase;    // "calibrating"
  std::int64_t done = 0;
  std::int64_t total = 0;  // 0: no count is shown (a phase with nothing to count)
  std::string unit;        // "sequences"
  double elapsed_s = 0;    // since the phase began
};

// "mdist quantize: calibrating 12/64 sequences | 0:03"
std::string phase_line(const PhaseReport& report);

class PhaseProgress {
 public:
  // `terminal`: whether to draw at all (rank 0 and a terminal; see terminal_stdout()).
  PhaseProgress(std::FILE* out, std::string command, bool terminal);
  ~PhaseProgress();
  PhaseProgress(const PhaseProgress&) = delete;
  PhaseProgress& operator=(const PhaseProgress&) = delete;

  // Ends the current phase, if any, and draws the new one at 0.
  void begin(std::string phase, std::int64_t total = 0, std::string unit = {});
  // Redraws the line (at most every 200 ms, and always when `done` reaches the total).
  void update(std::int64_t done);
  // Redraws the line with its final count and time and ends it, so that later output starts on
  // a fresh line.
  void finish();
  bool on_terminal() const { return terminal_; }

 private:
  void draw();

  std::FILE* out_;
  bool terminal_;
  PhaseReport report_;
  bool active_ = false;
  std::chrono::steady_clock::time_point start_{};
  std::chrono::steady_clock::time_point last_draw_{};
};

// Whether this process's stdout is a terminal: MDIST_STDOUT_IS_TTY when the launcher set it,
// isatty otherwise.
bool terminal_stdout();

}  // namespace mdist::cli
