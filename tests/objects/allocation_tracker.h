#pragma once
// Records the largest operator new request made while a ScopedAllocationTracker is alive, so
// tests can check that a corrupt length field cannot make the decoder allocate far more than
// the buffer holds. The replacement operator new lives in allocation_tracker.cpp: a separate
// translation unit keeps the compiler from pairing it with the free() in operator delete.
#include <cstddef>

namespace mdist::testing {

class ScopedAllocationTracker {
 public:
  ScopedAllocationTracker();
  ~ScopedAllocationTracker();
  ScopedAllocationTracker(const ScopedAllocationTracker&) = delete;
  ScopedAllocationTracker& operator=(const ScopedAllocationTracker&) = delete;

  // The largest single allocation since construction, in bytes.
  std::size_t largest() const;
};

}  // namespace mdist::testing
