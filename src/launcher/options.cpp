#include "options.h"

#include <CLI/CLI.hpp>
#include <charconv>
#include <limits>
#include <memory>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace mdist::launcher {
namespace {

constexpr std::string_view kDescription =
    "Starts --nproc-per-node copies of PROGRAM with torchrun's environment (RANK, WORLD_SIZE,\n"
    "MASTER_ADDR, ...). Everything from PROGRAM on is passed to it untouched.";

// CLI11 does not know PROGRAM (it is collected by prefix_command()), so spell the usage out.
class UsageFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App* /*app*/, std::string name) const override {
    return "\nUsage: " + name + " [OPTIONS] PROGRAM [ARGS...]\n";
  }
};

// Thrown for invalid flag values; turned into one "mdistrun: ..." line.
struct BadValue {
  std::string message;
};

template <typename T>
std::optional<T> parse_number(std::string_view text) {
  T value{};
  const char* const end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc{} || ptr != end || text.empty()) return std::nullopt;
  return value;
}

int parse_int_in_range(std::string_view flag, const std::string& text, long long min, long long max,
                       std::string_view expectation) {
  const std::optional<long long> value = parse_number<long long>(text);
  if (!value || *value < min || *value > max) {
    throw BadValue{std::string(flag) + " must be " + std::string(expectation) + ", got '" + text +
                   "'"};
  }
  return static_cast<int>(*value);
}

EarlyExit usage_error(const std::string& message) {
  return EarlyExit{.exit_code = 2,
                   .message = "mdistrun: " + message + " (see 'mdistrun --help')\n",
                   .to_stderr = true};
}

// The flags' values as given. They are read as strings and validated afterwards, so that
// every error is one precise line.
struct FlagText {
  std::string nproc = "1";
  std::string nnodes = "1";
  std::string node_rank = "0";
  std::string master_addr = "127.0.0.1";
  std::string master_port;
  std::string kill_timeout = "3";
  std::string max_restarts = "0";
  bool ignored_flag = false;
};

void add_flags(CLI::App& app, FlagText& text) {
  const auto take_last = CLI::MultiOptionPolicy::TakeLast;  // argparse semantics: last one wins
  const auto add = [&](const char* names, std::string& value, const char* type, const char* help) {
    app.add_option(names, value, help)->type_name(type)->multi_option_policy(take_last);
  };
  add("--nproc-per-node,--nproc_per_node", text.nproc, "N", "Ranks on this node (default 1)");
  add("--nnodes", text.nnodes, "M", "Number of nodes (default 1)");
  add("--node-rank,--node_rank", text.node_rank, "R", "This node's rank in [0, M) (default 0)");
  add("--master-addr,--master_addr", text.master_addr, "ADDR",
      "Address of node 0, where rank 0's store listens (default 127.0.0.1)");
  add("--master-port,--master_port", text.master_port, "PORT",
      "Port of the store; unset or 0: any free port (single node only)");
  add("--kill-timeout,--kill_timeout", text.kill_timeout, "SECONDS",
      "Grace period between SIGTERM and SIGKILL when stopping ranks (default 3)");
  add("--max-restarts,--max_restarts", text.max_restarts, "N",
      "After a rank fails, stop every rank and start them all again, up to N times (default 0)");
  app.add_flag("--standalone", text.ignored_flag,
               "Accepted for torchrun compatibility (no effect)");
  app.add_flag("--no-python,--no_python", text.ignored_flag,
               "Accepted for torchrun compatibility (no effect)");
  // Stop at the first non-option: PROGRAM and everything after it land in remaining().
  app.prefix_command();
}

// PROGRAM and its arguments from what CLI11 left; a usage error when there is none.
std::optional<EarlyExit> take_command(std::vector<std::string> remaining, LaunchOptions& options) {
  options.command = std::move(remaining);
  if (!options.command.empty() && options.command.front() == "--") {
    options.command.erase(options.command.begin());
  } else if (!options.command.empty() && options.command.front().starts_with('-')) {
    // prefix_command() hands unknown options over as if they were PROGRAM; reject them instead.
    return usage_error("unknown option '" + options.command.front() + "'");
  }
  if (options.command.empty()) return usage_error("missing PROGRAM to run");
  return std::nullopt;
}

// --nproc-per-node, --nnodes, --node-rank: a world size that fits an int. Throws BadValue.
void read_layout(const FlagText& text, LaunchOptions& options) {
  const int int_max = std::numeric_limits<int>::max();
  options.nproc_per_node =
      parse_int_in_range("--nproc-per-node", text.nproc, 1, int_max, "an integer >= 1");
  options.nnodes = parse_int_in_range("--nnodes", text.nnodes, 1, int_max, "an integer >= 1");
  options.node_rank =
      parse_int_in_range("--node-rank", text.node_rank, 0, int_max, "an integer in [0, nnodes)");
  if (options.node_rank >= options.nnodes) {
    throw BadValue{"--node-rank must be in [0, " + std::to_string(options.nnodes) + "), got " +
                   text.node_rank};
  }
  // The world size must fit the int that RANK/WORLD_SIZE consumers parse into.
  if (static_cast<long long>(options.nproc_per_node) * options.nnodes > int_max) {
    throw BadValue{"--nnodes * --nproc-per-node is too large"};
  }
}

// --master-port and --master-addr. Throws BadValue.
void read_rendezvous(const CLI::App& app, const FlagText& text, LaunchOptions& options) {
  options.master_port_given = app.count("--master-port") > 0;
  if (options.master_port_given) {
    options.master_port =
        parse_int_in_range("--master-port", text.master_port, 0, 65535, "an integer in 0..65535");
  }
  // Other nodes cannot learn a kernel-chosen port, so multi-node jobs must name one.
  if (options.nnodes > 1 && options.master_port == 0) {
    throw BadValue{"--master-port (non-zero) is required when --nnodes > 1"};
  }
  if (text.master_addr.empty()) throw BadValue{"--master-addr must not be empty"};
  options.master_addr = text.master_addr;
  options.master_addr_given = app.count("--master-addr") > 0;
}

// --kill-timeout and --max-restarts. Throws BadValue.
void read_stopping(const FlagText& text, LaunchOptions& options) {
  const std::optional<double> timeout = parse_number<double>(text.kill_timeout);
  // A day is far more than any graceful shutdown needs, and keeps the value finite.
  constexpr double kMaxKillTimeout = 24 * 60 * 60;
  if (!timeout || !(*timeout >= 0 && *timeout <= kMaxKillTimeout)) {
    throw BadValue{"--kill-timeout must be a number of seconds in [0, 86400], got '" +
                   text.kill_timeout + "'"};
  }
  options.kill_timeout_s = *timeout;
  options.max_restarts =
      parse_int_in_range("--max-restarts", text.max_restarts, 0, 1000000, "an integer >= 0");
  // Nodes would have to agree on each restart (torchrun's agents rendezvous for it).
  if (options.max_restarts > 0 && options.nnodes > 1) {
    throw BadValue{
        "--max-restarts needs a single node (--nnodes 1): restarting several nodes "
        "together needs an agent rendezvous mdistrun does not have"};
  }
}

}  // namespace

ParseResult parse_command_line(std::span<const std::string> args) {
  CLI::App app{std::string(kDescription), "mdistrun"};
  app.formatter(std::make_shared<UsageFormatter>());
  FlagText text;
  add_flags(app, text);

  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 consumes from the back
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    return EarlyExit{.exit_code = 0, .message = app.help(), .to_stderr = false};
  } catch (const CLI::ParseError& e) {
    return usage_error(e.what());
  }

  LaunchOptions options;
  if (auto exit = take_command(app.remaining(), options)) return *exit;
  // In a fixed order, so that a command line with several bad values always reports the same one.
  try {
    read_layout(text, options);
    read_rendezvous(app, text, options);
    read_stopping(text, options);
  } catch (const BadValue& bad) {
    return usage_error(bad.message);
  }
  return options;
}

}  // namespace mdist::launcher
