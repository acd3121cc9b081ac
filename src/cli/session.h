#pragma once
// Joining the job and talking to the user: the collective timeout, agreeing on bad input before
// any output exists, the rank-0 log line, the thread count, and proving an output location
// writable before anything is computed.
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

#include "mdist/runtime/runtime.h"
#include "src/cli/input_error.h"

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

// Creates `dir` if needed and proves it writable (a probe file is created and removed);
// InputError otherwise. Creates nothing when the path is not usable.
void check_writable_dir(const std::filesystem::path& dir, const char* what);
// Same for the directory that is to hold `file`.
void check_writable_file(const std::filesystem::path& file, const char* what);

// Threads for intra-op parallelism: OMP_NUM_THREADS when set (mdistrun sets 1 per rank for
// several ranks, as torchrun does), else libtorch's default.
void configure_threads();

// Prints on rank 0 (stdout, flushed).
void say(const std::string& line);

}  // namespace mdist::cli
