#include "allocation_tracker.h"

#include <atomic>
#include <cstdlib>
#include <new>

namespace {
std::atomic<bool> g_tracking{false};
std::atomic<std::size_t> g_largest{0};
}  // namespace

// Replaces the global allocation functions for the whole test program (libtorch included).
// The array and aligned forms keep their defaults, which call these or use their own pairs.
void* operator new(std::size_t size) {
  if (g_tracking.load(std::memory_order_relaxed)) {
    std::size_t largest = g_largest.load(std::memory_order_relaxed);
    while (size > largest && !g_largest.compare_exchange_weak(largest, size)) {
    }
  }
  if (void* const p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace mdist::testing {

ScopedAllocationTracker::ScopedAllocationTracker() {
  g_largest = 0;
  g_tracking = true;
}
ScopedAllocationTracker::~ScopedAllocationTracker() { g_tracking = false; }
std::size_t ScopedAllocationTracker::largest() const { return g_largest; }

}  // namespace mdist::testing
