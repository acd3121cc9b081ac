#!/usr/bin/env bash
# Sets up and builds (scripts/setup.sh), then runs every test: the ctest suite (single-process
# and multi-rank tests through mdistrun) and the object-decoder fuzzer for a fixed budget.
#   MDIST_FUZZ_SECONDS=0 scripts/test.sh   # skip the fuzzer
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600
if [[ "${MDIST_FUZZ_SECONDS:-60}" != 0 ]]; then
  MDIST_FUZZ_SECONDS="${MDIST_FUZZ_SECONDS:-60}" scripts/run_fuzz.sh
fi
