#pragma once
// Rank 0's view of a training run: on a terminal one progress bar redrawn in place (step, loss,
// tokens/s, ETA, peak memory of each rank); otherwise (a log file, CI) a plain line every
// `log_every` steps. Under mdistrun a rank's stdout is a pipe, so the launcher tells rank 0
// through MDIST_STDOUT_IS_TTY whether its own stdout is a terminal.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace mdist::cli {

struct StepReport {
  int step = 0;
  int total_steps = 0;
  double loss = 0;
  double lr = 0;
  double tokens_per_s = 0;
  double elapsed_s = 0;              // since the first step of this process began
  int steps_done_here = 0;           // steps this process ran (resumed runs start later)
  std::vector<double> peak_rss_mib;  // per rank
};

// "step 120/300 [#####.....]  40% | loss 2.3456 | lr 2.90e-03 | 5123 tok/s | ETA 0:45 |
//  peak MiB 812 790"
std::string progress_line(const StepReport& report, bool with_bar);

class Progress {
 public:
  Progress(std::FILE* out, int log_every);
  void update(const StepReport& report);
  // Ends the bar's line (a terminal) so that later output starts on a fresh line.
  void finish();
  // A line of its own between updates ("held-out loss 2.31 at step 100"); the bar, if any,
  // is redrawn by the next update.
  void note(const std::string& text);
  bool on_terminal() const { return terminal_; }

 private:
  std::FILE* out_;
  int log_every_;
  bool terminal_;
  bool drawn_ = false;
};

}  // namespace mdist::cli
