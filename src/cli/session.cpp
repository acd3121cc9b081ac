#include "src/cli/session.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include <torch/torch.h>

#include "mdist/objects/collectives.h"
#include "src/cli/flags.h"

namespace mdist::cli {

void agree_on_inputs(const std::function<void()>& check) {
  std::optional<std::string> problem;
  try {
    check();
  } catch (const InputError& error) {
    problem = error.what();
  }
  const auto problems = allgather(problem);
  for (const auto& p : problems) {
    if (p) throw AgreedInputError(*p, rank() == 0);
  }
}

SetupOptions setup_options(const std::optional<double>& timeout_s) {
  SetupOptions options;
  double seconds = 0;
  std::string source;
  if (timeout_s) {
    seconds = *timeout_s;
    source = "--timeout";
  } else if (const char* env = std::getenv("MDIST_TIMEOUT"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    seconds = std::strtod(env, &end);
    if (end == env || *end != '\0') seconds = std::nan("");
    source = "MDIST_TIMEOUT";
  } else {
    return options;
  }
  if (!std::isfinite(seconds) || !(seconds > 0) || seconds > 1e9) {
    throw InputError(
        source + " must be a positive number of seconds, got " +
        (timeout_s ? flag_value(seconds) : "'" + std::string(std::getenv("MDIST_TIMEOUT")) + "'"));
  }
  options.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000)));
  return options;
}

namespace {

// The nearest existing ancestor of `path` (itself included); it must be a directory we can
// create files in. Probing by creating a file, not access(2): root passes every access check.
void probe_writable(const std::filesystem::path& dir, const std::filesystem::path& path,
                    const char* what) {
  std::error_code ec;
  std::filesystem::path existing = std::filesystem::absolute(dir, ec);
  while (!std::filesystem::exists(existing, ec)) {
    if (!existing.has_parent_path() || existing.parent_path() == existing) break;
    existing = existing.parent_path();
  }
  if (!std::filesystem::is_directory(existing, ec)) {
    throw InputError(std::string(what) + " '" + path.string() + "' is not writable: '" +
                     existing.string() + "' is not a directory");
  }
  std::string probe = (existing / ".mdist-write-probe-XXXXXX").string();
  const int fd = mkstemp(probe.data());
  if (fd < 0) {
    throw InputError(std::string(what) + " '" + path.string() +
                     "' is not writable: " + std::strerror(errno));
  }
  close(fd);
  unlink(probe.c_str());
}

}  // namespace

void check_writable_dir(const std::filesystem::path& dir, const char* what) {
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec)) {
    throw InputError(std::string(what) + " '" + dir.string() + "' exists and is not a directory");
  }
  probe_writable(dir, dir, what);
}

void check_writable_file(const std::filesystem::path& file, const char* what) {
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec)) {
    throw InputError(std::string(what) + " '" + file.string() + "' is a directory");
  }
  probe_writable(file.has_parent_path() ? file.parent_path() : std::filesystem::path("."), file,
                 what);
}

void configure_threads() {
  if (const char* threads = std::getenv("OMP_NUM_THREADS")) {
    const int n = std::atoi(threads);
    if (n > 0) torch::set_num_threads(n);
  }
}

void say(const std::string& line) {
  if (rank() != 0) return;
  std::cout << line << std::endl;
}

}  // namespace mdist::cli
