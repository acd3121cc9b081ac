#!/usr/bin/env bash
# Sets up a fresh machine and builds mdist: Debian packages, the pinned libtorch (cached
# outside the clone), then a CMake build in build/ (executables in build/bin/) of what the main
# job needs: the library, `mdist`, `mdistrun` and the demo. scripts/test.sh builds the rest
# (tests, benchmarks); so does a plain `cmake --build build`.
#   MDIST_CMAKE_ARGS="-DCMAKE_BUILD_TYPE=Debug" scripts/setup.sh   # extra CMake arguments
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install_deps.sh
libtorch="$(scripts/install_libtorch.sh | tail -n 1)"

# shellcheck disable=SC2086 # MDIST_CMAKE_ARGS is a list of arguments
cmake -S . -B build -DMDIST_LIBTORCH="$libtorch" ${MDIST_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "$(nproc)" --target mdist mdist_cli mdistrun mdist-demo
