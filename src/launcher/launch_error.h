// The one exception type the launcher reports to the user: main() prints "mdistrun: <what>"
// once and exits with exit_code().
#pragma once

#include <stdexcept>
#include <string>

namespace mdist::launcher {

class LaunchError : public std::runtime_error {
 public:
  LaunchError(const std::string& message, int exit_code)
      : std::runtime_error(message), exit_code_(exit_code) {}
  [[nodiscard]] int exit_code() const noexcept { return exit_code_; }

 private:
  int exit_code_;
};

}  // namespace mdist::launcher
