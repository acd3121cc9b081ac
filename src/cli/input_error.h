#pragma once
// The errors of the `mdist` command. Bad input to it (a flag, a file, data that does not fit the
// model): reported as one line on rank 0 and exit code 2, before any output file is created.
#include <string>

#include "mdist/error.h"

namespace mdist::cli {

// Bad input to the command (mdist::InputError, include/mdist/error.h).
using mdist::InputError;

// A failure every rank knows of alike (bad input agreed on, a non-finite training step seen
// through global values): rank 0 prints the one line, every rank exits with exit_code.
class AgreedFailure : public Error {
 public:
  AgreedFailure(const std::string& message, bool reporter, int exit_code)
      : Error(message), reporter_(reporter), exit_code_(exit_code) {}
  // Whether this rank prints the message (rank 0 does; the others stay quiet).
  bool reporter() const { return reporter_; }
  int exit_code() const { return exit_code_; }

 private:
  bool reporter_;
  int exit_code_;
};

// Thrown on every rank when some rank's inputs were bad (exit code 2).
class AgreedInputError : public AgreedFailure {
 public:
  AgreedInputError(const std::string& message, bool reporter)
      : AgreedFailure(message, reporter, 2) {}
};

}  // namespace mdist::cli
