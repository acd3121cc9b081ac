#pragma once
// Bad input to the `mdist` command (a flag, a file, data that does not fit the model): reported
// as one line on rank 0 and exit code 2, before any output file is created.
#include <string>

#include "mdist/error.h"

namespace mdist::cli {

class InputError : public Error {
 public:
  using Error::Error;
};

}  // namespace mdist::cli
