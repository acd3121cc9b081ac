#include "output_prefixer.h"

namespace mdist::launcher {

OutputPrefixer::OutputPrefixer(int global_rank, std::size_t max_pending)
    : prefix_("[rank" + std::to_string(global_rank) + "]: "), max_pending_(max_pending) {}

void OutputPrefixer::feed(std::string_view chunk, std::string& out) {
  // A line ends at '\n'; a segment ending at '\r' (a progress bar redrawn in place) is passed
  // on at once, prefixed and still ending in '\r', so the terminal redraws the prefixed line.
  for (std::size_t end = chunk.find_first_of("\r\n"); end != std::string_view::npos;
       end = chunk.find_first_of("\r\n")) {
    const char terminator = chunk[end];
    if (pending_.empty()) {
      emit(chunk.substr(0, end), out, terminator);  // common case: no copy into pending_
    } else {
      pending_.append(chunk.substr(0, end));
      emit(pending_, out, terminator);
      pending_.clear();
    }
    chunk.remove_prefix(end + 1);
  }
  pending_.append(chunk);
  if (pending_.size() >= max_pending_) {
    emit(pending_, out, '\n');
    pending_.clear();
  }
}

void OutputPrefixer::finish(std::string& out) {
  if (pending_.empty()) return;
  emit(pending_, out, '\n');
  pending_.clear();
}

void OutputPrefixer::emit(std::string_view line, std::string& out, char terminator) {
  // A bare "\r", or the "\n" that ends a redrawn line ("bar\r\n", CRLF): no empty prefixed
  // line, which would be noise in a log file.
  const bool bare = line.empty() && (terminator == '\r' || after_cr_);
  after_cr_ = terminator == '\r';
  if (bare) {
    out.push_back(terminator);
    return;
  }
  out.append(prefix_);
  out.append(line);
  out.push_back(terminator);
}

}  // namespace mdist::launcher
