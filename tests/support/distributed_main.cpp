// main() of the multi-rank test binaries: every rank joins the job (started by mdistrun),
// runs the same tests in the same order (collectives must match), then leaves.
#include <gtest/gtest.h>

#include <iostream>

#include "mdist/runtime/runtime.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  try {
    // Short enough that a broken test fails instead of hanging CI, long enough for 4 ranks
    // on 2 loaded cores.
    mdist::setup(std::chrono::seconds(60));
  } catch (const std::exception& error) {
    std::cerr << error.what() << std::endl;
    return 1;
  }
  const int result = RUN_ALL_TESTS();
  mdist::cleanup();
  return result;
}
