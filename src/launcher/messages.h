// The launcher's own diagnostics: one "mdistrun: ..." line on stderr, written with a single
// write() so it never interleaves with rank output forwarded on the same stream.
#pragma once

#include <string_view>

namespace mdist::launcher {

void report(std::string_view message) noexcept;

}  // namespace mdist::launcher
