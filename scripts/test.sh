#!/usr/bin/env bash
# Sets up and builds (scripts/setup.sh), then runs every test: the ctest suite (single-process
# and multi-rank tests through mdistrun), the suite again under ASan+UBSan and the launcher and
# FSDP prefetch tests under TSan (scripts/sanitize.sh), and the fuzzers for a fixed budget.
#   MDIST_SANITIZE=0 scripts/test.sh           # skip the sanitizer stages
#   MDIST_FUZZ_SECONDS=0 scripts/test.sh       # skip the fuzzers (default: 20 s each; longer
#                                              # runs: scripts/fuzz_long.sh)
#   MDIST_CHECK_CUDA_BUILD=0 scripts/test.sh   # skip the CUDA compile-and-link check
set -euo pipefail
cd "$(dirname "$0")/.."

# stage NAME COMMAND...: runs one stage and reports its wall time (docs/testing.md keeps them).
started=$SECONDS
stage() {
  local name="$1" start=$SECONDS
  shift
  "$@"
  echo "test.sh: $name took $((SECONDS - start)) s (total $((SECONDS - started)) s)"
}
stage setup scripts/setup.sh
stage build cmake --build build -j "$(nproc)" # the tests and benchmarks setup.sh leaves out
stage ctest ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600
if [[ "${MDIST_SANITIZE:-1}" == 1 ]]; then
  stage sanitize scripts/sanitize.sh
fi
# The CUDA/NCCL path must keep compiling even where no GPU runs it.
if [[ "${MDIST_CHECK_CUDA_BUILD:-1}" == 1 ]]; then
  stage cuda-build scripts/build_cuda.sh
fi
if [[ "${MDIST_FUZZ_SECONDS:-20}" != 0 ]]; then
  export MDIST_FUZZ_SECONDS="${MDIST_FUZZ_SECONDS:-20}"
  stage fuzz scripts/run_fuzz.sh
fi
