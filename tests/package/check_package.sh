#!/usr/bin/env bash
# Installs the build into a scratch prefix, then configures, builds and runs a consumer
# project that uses find_package(mdist CONFIG) and mdist::mdist.
#   check_package.sh BUILD_DIR SCRATCH_DIR
set -euo pipefail
build="$1"
mkdir -p "$2"
scratch="$(cd "$2" && pwd)"
here="$(cd "$(dirname "$0")" && pwd)"
rm -rf "$scratch"
cmake --install "$build" --prefix "$scratch/prefix" >/dev/null
cmake -S "$here" -B "$scratch/consumer" -DCMAKE_PREFIX_PATH="$scratch/prefix" >/dev/null
cmake --build "$scratch/consumer" >/dev/null
"$scratch/consumer/consumer"
