#!/usr/bin/env bash
# Sets up a fresh machine and builds mdist: Debian packages, the pinned libtorch (cached
# outside the clone), then a CMake build in build/ (executables in build/bin/).
#   MDIST_CMAKE_ARGS="-DCMAKE_BUILD_TYPE=Debug" scripts/setup.sh   # extra CMake arguments
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install_deps.sh
libtorch="$(scripts/install_libtorch.sh | tail -n 1)"

# ccache shares objects between clones of this repository on one machine (CI clones anew).
export CCACHE_BASEDIR="$PWD"
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
export CCACHE_NOHASHDIR=1

# shellcheck disable=SC2086 # MDIST_CMAKE_ARGS is a list of arguments
cmake -S . -B build -DMDIST_LIBTORCH="$libtorch" ${MDIST_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "$(nproc)"
