#!/usr/bin/env bash
# Sets up and builds (scripts/setup.sh), then runs every test: the ctest suite (single-process
# and multi-rank tests through mdistrun), the suite again under ASan+UBSan and the launcher and
# FSDP prefetch tests under TSan (scripts/sanitize.sh), and the fuzzers for a fixed budget.
#   MDIST_SANITIZE=0 scripts/test.sh           # skip the sanitizer stages
#   MDIST_FUZZ_SECONDS=0 scripts/test.sh       # skip the fuzzers
#   MDIST_CHECK_CUDA_BUILD=0 scripts/test.sh   # skip the CUDA compile-and-link check
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cmake --build build -j "$(nproc)" # the tests and benchmarks setup.sh leaves out
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600
if [[ "${MDIST_SANITIZE:-1}" == 1 ]]; then
  scripts/sanitize.sh
fi
# The CUDA/NCCL path must keep compiling even where no GPU runs it.
if [[ "${MDIST_CHECK_CUDA_BUILD:-1}" == 1 ]]; then
  scripts/build_cuda.sh
fi
if [[ "${MDIST_FUZZ_SECONDS:-60}" != 0 ]]; then
  MDIST_FUZZ_SECONDS="${MDIST_FUZZ_SECONDS:-60}" scripts/run_fuzz.sh
fi
