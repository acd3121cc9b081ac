#pragma once
// The message of the mdist::Error that `fn` throws, or "no error": tests compare messages.
#include <string>
#include <utility>

#include "mdist/error.h"

namespace mdist::testing {

template <class F>
std::string error_of(F&& fn) {
  try {
    std::forward<F>(fn)();
  } catch (const mdist::Error& error) {
    return error.what();
  }
  return "no error";
}

}  // namespace mdist::testing
