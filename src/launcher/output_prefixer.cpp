#include "output_prefixer.h"

namespace mdist::launcher {

OutputPrefixer::OutputPrefixer(int global_rank, std::size_t max_pending)
    : prefix_("[rank" + std::to_string(global_rank) + "]: "), max_pending_(max_pending) {}

void OutputPrefixer::feed(std::string_view chunk, std::string& out) {
  for (std::size_t newline = chunk.find('\n'); newline != std::string_view::npos;
       newline = chunk.find('\n')) {
    if (pending_.empty()) {
      emit(chunk.substr(0, newline), out);  // common case: no copy into pending_
    } else {
      pending_.append(chunk.substr(0, newline));
      emit(pending_, out);
      pending_.clear();
    }
    chunk.remove_prefix(newline + 1);
  }
  pending_.append(chunk);
  if (pending_.size() >= max_pending_) {
    emit(pending_, out);
    pending_.clear();
  }
}

void OutputPrefixer::finish(std::string& out) {
  if (pending_.empty()) return;
  emit(pending_, out);
  pending_.clear();
}

void OutputPrefixer::emit(std::string_view line, std::string& out) {
  out.append(prefix_);
  out.append(line);
  out.push_back('\n');
}

}  // namespace mdist::launcher
