#pragma once
// Runs a program for a test and collects what a user would see: exit code, stdout, stderr.
#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace mdist::testing {

struct RunResult {
  int exit_code = -1;  // 128 + signal when killed by a signal
  std::string out;
  std::string err;
  std::chrono::milliseconds elapsed{0};
};

struct RunOptions {
  // Variables to set (an empty value unsets the variable) on top of this process's environment.
  std::map<std::string, std::string> env;
  // Launcher variables of the test process itself (RANK, WORLD_SIZE, ...) are removed first.
  bool clear_launch_env = true;
  std::chrono::seconds timeout{120};  // then the child is killed and the result says so
  // The child's stdout is a pseudo-terminal (its stderr stays a pipe), as a user's terminal
  // is: to see what a command draws there. Its line discipline turns "\n" into "\r\n".
  bool stdout_terminal = false;
};

RunResult run(const std::vector<std::string>& argv, const RunOptions& options = {});

// A TCP port that was free a moment ago on 127.0.0.1.
int free_port();

// Holds a listening socket on 127.0.0.1 for the test's lifetime (port in use).
class HeldPort {
 public:
  HeldPort();
  ~HeldPort();
  HeldPort(const HeldPort&) = delete;
  HeldPort& operator=(const HeldPort&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace mdist::testing
