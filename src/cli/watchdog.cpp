#include "src/cli/watchdog.h"

#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "mdist/runtime/c10d.h"
#include "mdist/runtime/runtime.h"

namespace mdist::cli {
namespace {

std::string key_of(int rank) { return "mdist/watchdog/step/" + std::to_string(rank); }

std::vector<uint8_t> bytes_of(const std::string& text) { return {text.begin(), text.end()}; }

}  // namespace

StepWatchdog::StepWatchdog(std::chrono::milliseconds after)
    : after_(after), enabled_(after.count() > 0 && is_initialized() && size() > 1) {
  if (enabled_) thread_ = std::thread([this] { run(); });
}

StepWatchdog::~StepWatchdog() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void StepWatchdog::reached(std::int64_t step) { step_ = step; }

void StepWatchdog::run() {
  const int world = size();
  const int me = rank();
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back(key_of(r));
  seen_.resize(static_cast<std::size_t>(world));
  const auto poll = std::max(std::chrono::milliseconds(50), after_ / 4);
  std::int64_t beat = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  do {
    try {
      const auto store = mdist::store();
      store->set(key_of(me), bytes_of(std::to_string(step_.load()) + " " + std::to_string(beat++)));
      if (me == 0 && store->check(keys)) {
        std::vector<std::string> values;
        for (const auto& value : store->multiGet(keys))
          values.emplace_back(value.begin(), value.end());
        check(values);
      }
    } catch (const std::exception&) {
      return;  // the job is going down; its collectives report why
    }
  } while (!wake_.wait_for(lock, poll, [this] { return stopping_; }));
}

void StepWatchdog::check(const std::vector<std::string>& values) {
  const auto now = std::chrono::steady_clock::now();
  std::int64_t leader = 0;
  std::vector<std::pair<std::int64_t, std::int64_t>> posted;
  for (const auto& value : values) {
    const auto space = value.find(' ');
    posted.emplace_back(std::stoll(value.substr(0, space)), std::stoll(value.substr(space + 1)));
    leader = std::max(leader, posted.back().first);
  }
  for (std::size_t r = 0; r < posted.size(); ++r) {
    auto& seen = seen_[r];
    const auto [step, beat] = posted[r];
    if (step != seen.step) {
      seen.step = step;
      seen.step_since = now;
      seen.reported = false;
    }
    if (beat != seen.beat) {
      seen.beat = beat;
      seen.beat_since = now;
    }
    const bool lagging = step < leader && now - seen.step_since >= after_;
    const bool silent = now - seen.beat_since >= after_;
    if (seen.reported || !(lagging || silent)) continue;
    seen.reported = true;
    const auto since = silent ? seen.beat_since : seen.step_since;
    const auto s = std::chrono::duration_cast<std::chrono::seconds>(now - since).count();
    std::cerr << "mdist train: watchdog: rank " << r;
    if (silent) {
      // Its posts are sampled, so the step is where it was last seen, not exact.
      std::cerr << " has given no sign of life for " << s << " s (stopped or frozen; last seen at "
                << "step " << step << ", the leading rank at step " << leader << ")";
    } else {
      std::cerr << " has not reached step " << leader << " for " << s << " s (it is at step "
                << step << ")";
    }
    std::cerr << "; the others wait for it until --timeout" << std::endl;
  }
}

}  // namespace mdist::cli
