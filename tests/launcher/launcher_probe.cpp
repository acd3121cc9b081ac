// launcher_probe: a stand-in "training program" for the mdistrun tests. Its first argument
// picks a behaviour; each behaviour exercises one part of the launcher's contract.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr int kLongSleepSeconds = 60;

int env_int(const char* name) {
  const char* const value = std::getenv(name);
  return value != nullptr ? std::atoi(value) : -1;
}

int my_rank() { return env_int("RANK"); }

std::string env_or_unset(const char* name) {
  const char* const value = std::getenv(name);
  return value != nullptr ? value : "<unset>";
}

// Writes `text` to `path` atomically (rename), so a test polling for the file never reads it
// half-written.
void write_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << text;
  }
  std::rename(tmp.c_str(), path.c_str());
}

bool file_exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// Waits (up to 20 s) until FILE_PREFIX.<r>.<suffix> exists for every rank r.
void wait_for_all_ranks(const std::string& prefix, const std::string& suffix) {
  const int world = env_int("WORLD_SIZE");
  for (int tries = 0; tries < 2000; ++tries) {
    bool all = true;
    for (int r = 0; r < world; ++r) {
      all = all && file_exists(prefix + "." + std::to_string(r) + "." + suffix);
    }
    if (all) return;
    ::usleep(10'000);
  }
}

[[noreturn]] void sleep_long_then_exit() {
  ::sleep(kLongSleepSeconds);
  std::_Exit(0);
}

struct SocketInfo {
  bool listening = false;
  std::string address;
  int port = -1;
};

std::optional<SocketInfo> inspect_socket(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return std::nullopt;
  SocketInfo info;
  int accepting = 0;
  socklen_t len = sizeof(accepting);
  info.listening = ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len) == 0 && accepting;
  sockaddr_in sa{};
  socklen_t sa_len = sizeof(sa);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &sa_len) == 0 &&
      sa.sin_family == AF_INET) {
    char buffer[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &sa.sin_addr, buffer, sizeof(buffer));
    info.address = buffer;
    info.port = ntohs(sa.sin_port);
  }
  return info;
}

std::vector<int> open_fds() {
  std::vector<int> fds;
  DIR* const dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return fds;
  while (const dirent* const entry = ::readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    const int fd = std::atoi(entry->d_name);
    if (fd != ::dirfd(dir)) fds.push_back(fd);
  }
  ::closedir(dir);
  return fds;
}

// Open fds that are listening sockets bound to `port` (only rank 0 should have one).
int count_listeners_on(int port) {
  int count = 0;
  for (const int fd : open_fds()) {
    const std::optional<SocketInfo> info = inspect_socket(fd);
    if (info && info->listening && info->port == port) ++count;
  }
  return count;
}

// Fds beyond stdin/stdout/stderr and the store socket: leaks from the launcher or its parent.
std::string stray_fds(int listen_fd) {
  std::string list;
  for (const int fd : open_fds()) {
    if (fd <= STDERR_FILENO || fd == listen_fd) continue;
    list += (list.empty() ? "" : ",") + std::to_string(fd);
  }
  return list;
}

int print_env() {
  std::string out;
  for (const char* name :
       {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
        "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID", "MDIST_STORE_LISTEN_FD"}) {
    out += std::string(name) + "=" + env_or_unset(name) + "\n";
  }
  const char* const fd_text = std::getenv("MDIST_STORE_LISTEN_FD");
  std::optional<SocketInfo> listen;
  if (fd_text != nullptr) listen = inspect_socket(std::atoi(fd_text));
  out += "LISTEN_FD_IS_SOCKET=" + std::to_string(listen.has_value()) + "\n";
  out += "LISTEN_FD_LISTENING=" + std::to_string(listen && listen->listening) + "\n";
  out += "LISTEN_FD_ADDR=" + (listen ? listen->address + ":" + std::to_string(listen->port) : "") +
         "\n";
  out += "STRAY_FDS=" + stray_fds(fd_text != nullptr ? std::atoi(fd_text) : -1) + "\n";
  out +=
      "MASTER_PORT_LISTENERS=" + std::to_string(count_listeners_on(env_int("MASTER_PORT"))) + "\n";
  // The launcher's process-group and signal set-up must not leak into the program.
  out += "OWN_PROCESS_GROUP=" + std::to_string(::getpgrp() == ::getpid()) + "\n";
  sigset_t mask;
  ::sigprocmask(SIG_SETMASK, nullptr, &mask);
  bool blocked = false;
  for (const int signo : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT}) {
    blocked = blocked || sigismember(&mask, signo) == 1;
  }
  out += "SIGNALS_UNBLOCKED=" + std::to_string(!blocked) + "\n";
  struct sigaction pipe_action {};
  ::sigaction(SIGPIPE, nullptr, &pipe_action);
  out += "SIGPIPE_DEFAULT=" + std::to_string(pipe_action.sa_handler == SIG_DFL) + "\n";
  std::fputs(out.c_str(), stdout);
  return 0;
}

int exit_on_rank(int rank, int code) {
  if (my_rank() != rank) sleep_long_then_exit();
  std::printf("rank %d exiting with %d\n", rank, code);
  std::fflush(stdout);
  return code;
}

// Rank 1 fails (exit 3) on every attempt before restart `until`; from then on every rank says
// which attempt it is and succeeds.
int fail_until_restart(int until) {
  const char* count = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const int attempt = count != nullptr ? std::atoi(count) : -1;
  if (attempt < until) {
    if (my_rank() != 1) sleep_long_then_exit();
    return 3;
  }
  std::printf("rank %d attempt %d\n", my_rank(), attempt);
  std::fflush(stdout);
  return 0;
}

int segv_on_rank(int rank) {
  if (my_rank() != rank) sleep_long_then_exit();
  // No core file: the test only cares about the signal, and dumping can be slow.
  const rlimit no_core{0, 0};
  ::setrlimit(RLIMIT_CORE, &no_core);
  ::signal(SIGSEGV, SIG_DFL);
  ::raise(SIGSEGV);
  return 0;
}

// Paths for the async-signal-safe handler, prepared before it is installed.
std::string g_term_path;
std::string g_int_path;
std::string g_hup_path;

void record_signal(int signo) {
  const std::string& path = signo == SIGTERM  ? g_term_path
                            : signo == SIGINT ? g_int_path
                                              : g_hup_path;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd >= 0) ::close(fd);
  ::_exit(0);
}

int sleep_and_record_signal(const std::string& prefix) {
  const std::string base = prefix + "." + std::to_string(my_rank());
  g_term_path = base + ".term";
  g_int_path = base + ".int";
  g_hup_path = base + ".hup";
  struct sigaction action {};
  action.sa_handler = record_signal;
  for (const int signo : {SIGTERM, SIGINT, SIGHUP}) ::sigaction(signo, &action, nullptr);
  // Announce readiness only once the handlers are in place.
  write_file(base + ".pid", std::to_string(::getpid()));
  sleep_long_then_exit();
}

// Rank `rank` exits `code` once every other rank ignores SIGTERM, so only SIGKILL after the
// grace period can end them.
int stubborn_others(const std::string& prefix, int rank, int code) {
  const std::string base = prefix + "." + std::to_string(my_rank());
  if (my_rank() != rank) {
    ::signal(SIGTERM, SIG_IGN);
    write_file(base + ".ready", "");
    for (;;) ::pause();
  }
  write_file(base + ".ready", "");
  wait_for_all_ranks(prefix, "ready");
  return code;
}

pid_t fork_sleeper(bool new_session) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (new_session) ::setsid();  // escapes the rank's process group
    ::sleep(kLongSleepSeconds);
    ::_exit(0);
  }
  return pid;
}

// Each rank starts two long sleepers (one in its group, one that left it with setsid) and
// records their pids; then rank 0 exits 5 while the others keep sleeping.
int spawn_grandchild(const std::string& prefix) {
  const pid_t in_group = fork_sleeper(false);
  const pid_t escaped = fork_sleeper(true);
  write_file(prefix + "." + std::to_string(my_rank()) + ".grandchildren",
             std::to_string(in_group) + " " + std::to_string(escaped) + "\n");
  if (my_rank() != 0) sleep_long_then_exit();
  wait_for_all_ranks(prefix, "grandchildren");
  return 5;
}

int partial_line() {
  std::fputs("complete line\nno newline at the end", stdout);
  std::fputs("stderr without newline", stderr);
  return 0;
}

// N numbered lines on stdout and on stderr, interleaved, to check ordering and separation.
int lines(int count) {
  for (int i = 0; i < count; ++i) {
    std::printf("out %d\n", i);
    std::fflush(stdout);
    std::fprintf(stderr, "err %d\n", i);
  }
  return 0;
}

int echo_args(int argc, char** argv) {
  for (int i = 0; i < argc; ++i) std::printf("ARG=%s\n", argv[i]);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  const auto arg = [&](std::size_t i) { return i < args.size() ? args[i] : std::string(); };
  const std::string mode = arg(0);
  if (mode == "print-env") return print_env();
  if (mode == "exit-on-rank") return exit_on_rank(std::stoi(arg(1)), std::stoi(arg(2)));
  if (mode == "segv-on-rank") return segv_on_rank(std::stoi(arg(1)));
  if (mode == "fail-until-restart") return fail_until_restart(std::stoi(arg(1)));
  if (mode == "sleep-and-record-signal") return sleep_and_record_signal(arg(1));
  if (mode == "stubborn-others") {
    return stubborn_others(arg(1), std::stoi(arg(2)), std::stoi(arg(3)));
  }
  if (mode == "spawn-grandchild") return spawn_grandchild(arg(1));
  if (mode == "partial-line") return partial_line();
  if (mode == "lines") return lines(std::stoi(arg(1)));
  if (mode == "echo-args") return echo_args(argc - 2, argv + 2);
  std::fprintf(stderr, "launcher_probe: unknown mode '%s'\n", mode.c_str());
  return 64;
}
