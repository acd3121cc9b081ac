// Splits one rank's output stream into lines and prefixes each with "[rank<R>]: ".
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace mdist::launcher {

class OutputPrefixer {
 public:
  // A line that grows past this without a newline (e.g. a \r progress bar) is emitted anyway,
  // so a chatty rank cannot make the launcher buffer without bound.
  static constexpr std::size_t kMaxPendingLine = std::size_t{1} << 20;

  explicit OutputPrefixer(int global_rank, std::size_t max_pending = kMaxPendingLine);

  // Appends every line completed by `chunk` (prefixed, newline-terminated) to `out`, and
  // every segment ended by '\r' (prefixed, '\r'-terminated).
  void feed(std::string_view chunk, std::string& out);
  // At EOF: appends the unterminated last line, if any, with a newline added.
  void finish(std::string& out);

 private:
  void emit(std::string_view line, std::string& out, char terminator);

  std::string prefix_;
  std::string pending_;
  std::size_t max_pending_;
  bool after_cr_ = false;  // the last segment emitted ended in '\r'
};

}  // namespace mdist::launcher
