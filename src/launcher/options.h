// Command-line flags of mdistrun (torchrun-compatible subset) parsed into a plain struct.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

namespace mdist::launcher {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  bool master_addr_given = false;
  // 0 means "let the kernel choose" (single node only).
  int master_port = 0;
  bool master_port_given = false;
  double kill_timeout_s = 3.0;
  // torchrun's --max-restarts: after a failure every rank is stopped and all start again, with
  // TORCHELASTIC_RESTART_COUNT counting the restarts, at most this many times (single node).
  int max_restarts = 0;
  // PROGRAM followed by its arguments, exactly as given.
  std::vector<std::string> command;
};

// Parsing ended without a job to run: --help (exit 0, text for stdout) or bad input
// (non-zero exit, a single "mdistrun: ..." line for stderr).
struct EarlyExit {
  int exit_code = 0;
  std::string message;  // includes the trailing newline
  bool to_stderr = false;
};

using ParseResult = std::variant<LaunchOptions, EarlyExit>;

// `args` excludes argv[0].
[[nodiscard]] ParseResult parse_command_line(std::span<const std::string> args);

}  // namespace mdist::launcher
