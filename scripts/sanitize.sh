#!/usr/bin/env bash
# The sanitizer stages of CI (scripts/test.sh runs them after the normal ctest). Each builds the
# tree in a build directory of its own with MDIST_SANITIZE and runs tests under ctest; any
# sanitizer report makes its test, and so this script, fail.
#
#   asan: AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/). Every library test
#         (ctest labels unit and dist: the single-process binaries, the multi-rank tests on 1-4
#         ranks, the fault and launcher tests; the two-node tests, label multinode, run the same
#         launcher and rendezvous code in network namespaces and are left to the plain suite) and a subset of the `mdist` command's
#         end-to-end tests that runs each subcommand once (train, resume, eval, calibrate,
#         generate, tokenize, validation, --ep): $asan_cli_subset below. The whole end-to-end
#         suite under ASan (about 8 more minutes on 2 cores, the same library code driven by more
#         flag combinations) is the stage asan-cli, run on request, not by scripts/test.sh.
#         Left out: package.find_package_consumer (the consumer it builds is not linked with the
#         ASan runtime, which must come first in a process that loads an ASan-built
#         libmdist.so) and the two tests that bound a command's peak RSS (ASan's quarantine
#         keeps freed memory resident, 256 MiB by default, so the bound measures the sanitizer).
#         Leak detection is on; the leaks reported from inside the uninstrumented libtorch are
#         suppressed by scripts/sanitizers/lsan.supp, never mdist's own frames.
#   asan-cli: the asan build, every `mdist` command end-to-end test (ctest label cli) but the
#         peak-RSS bounds.
#   tsan: ThreadSanitizer (build-tsan/). The launcher (mdistrun, tests/launcher) and the FSDP
#         test with prefetch (fully_shard_test) on 1 rank. On 2-4 ranks every report was inside
#         the uninstrumented libtorch/Gloo (see scripts/sanitizers/tsan.supp): that path needs
#         a TSan-built libtorch.
#
#   scripts/sanitize.sh                 # asan and tsan (what scripts/test.sh runs)
#   scripts/sanitize.sh asan            # one of them
#   scripts/sanitize.sh asan-cli        # every end-to-end test of the mdist command under ASan
#   MDIST_SANITIZE_TESTS='^codec' scripts/sanitize.sh asan   # a subset (ctest -R regex)
#
# Environment:
#   MDIST_SANITIZE_JOBS   parallel compile jobs and ctest jobs (default: nproc)
#   MDIST_SANITIZE_TESTS  ctest -R regex replacing a stage's selection (default: all of the stage)
# The sanitizer settings below are exported for the build too: gtest_discover_tests runs the
# instrumented test binaries while building to list their tests.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${MDIST_SANITIZE_JOBS:-$(nproc)}"
suppressions="$repo/scripts/sanitizers"
stages=("$@")
if [[ ${#stages[@]} -eq 0 ]]; then
  stages=(asan tsan)
fi

libtorch="$("$repo/scripts/install_libtorch.sh" | tail -n 1)"

# configure BUILD_DIR SANITIZERS
configure() {
  local build="$1" sanitizers="$2"
  mkdir -p "$build"
  # -O1 (what the sanitizers' own documentation recommends) and line tables only (-g1: enough for
  # file:line in every report): the cold instrumented build took 908 s against 1142 s at -O2 -g
  # and its objects take a fraction of the compiler cache.
  if ! cmake -S "$repo" -B "$build" -DMDIST_LIBTORCH="$libtorch" -DMDIST_SANITIZE="$sanitizers" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
    -DMDIST_BUILD_BENCH=OFF > "$build/configure.log" 2>&1; then
    cat "$build/configure.log" >&2
    echo "sanitize: configuring $build failed" >&2
    exit 2
  fi
}

# run_ctest STAGE BUILD_DIR REGEX CTEST_ARGS...: runs the stage's tests (ctest -R REGEX, or
# MDIST_SANITIZE_TESTS when set) and reports the time taken.
run_ctest() {
  local stage="$1" build="$2" regex="${MDIST_SANITIZE_TESTS:-$3}"
  shift 3
  local start=$SECONDS
  if ! ctest --test-dir "$build" --output-on-failure -j "$jobs" --timeout 900 -R "$regex" "$@"; then
    echo "sanitize: $stage: tests failed or a sanitizer reported (see the output above)" >&2
    exit 1
  fi
  echo "sanitize: $stage: tests passed in $((SECONDS - start)) s"
}

# The end-to-end tests of the `mdist` command that the asan stage runs: one or two per
# subcommand and per kind of run (see the header).
asan_cli_subset='^Mdist(Command\.(ResumeReproducesTheUninterruptedRun|EvalAndCalibrateDoNotDependOnTheRankCount|GenerateSamplesBytesAndIsTheSameOnEveryRankCount)|Checks\.(UsageErrorsAreOneLineWithExitCodeTwo|ResumeValidatesTheTrainerStateAndTheOptimizerFiles)|Tokenizer\.(TokenizeWritesEncodePlusEosPerDocumentOnAnyRankCount|TextDataGoesThroughTheModelsTokenizer)|MoeTrain\.ResumesAcrossExpertParallelLayouts)$'

# build_asan: configures and builds build-asan/ with the sanitizer settings exported.
build_asan() {
  local build="$1"
  # halt_on_error/-fno-sanitize-recover: the first report ends the process with a failure.
  export ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=1:strict_string_checks=1:check_initialization_order=1"
  export LSAN_OPTIONS="suppressions=$suppressions/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
  local start=$SECONDS
  configure "$build" "address;undefined"
  cmake --build "$build" -j "$jobs"
  echo "sanitize: asan: built in $((SECONDS - start)) s"
}

asan_stage() {
  local build="$repo/build-asan"
  build_asan "$build"
  if [[ -n "${MDIST_SANITIZE_TESTS:-}" ]]; then
    run_ctest asan "$build" . -E '^package\.|PeakMemoryOf'
    return
  fi
  run_ctest asan "$build" . -L '^(unit|dist)$'
  run_ctest asan-cli-subset "$build" "$asan_cli_subset"
}

asan_cli_stage() {
  local build="$repo/build-asan"
  build_asan "$build"
  run_ctest asan-cli "$build" . -L '^cli$' -E 'PeakMemoryOf'
}

tsan_stage() {
  local build="$repo/build-tsan"
  # libgomp (libtorch's OpenMP) is not instrumented and its barriers are invisible to TSan, so
  # intra-op parallel kernels would show as races on their tensors: one OpenMP thread.
  # Gloo's threads, which matter here, synchronise through pthread calls TSan intercepts.
  export OMP_NUM_THREADS=1
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$suppressions/tsan.supp"
  local start=$SECONDS
  configure "$build" "thread"
  cmake --build "$build" -j "$jobs" --target mdistrun launcher_test launcher_unit_test \
    launcher_probe fully_shard_test
  echo "sanitize: tsan: built in $((SECONDS - start)) s"
  run_ctest tsan "$build" '^(launcher\.|fully_shard_test\.np1$)'
}

for stage in "${stages[@]}"; do
  case "$stage" in
    asan) asan_stage ;;
    asan-cli) asan_cli_stage ;;
    tsan) tsan_stage ;;
    *)
      echo "sanitize: unknown stage '$stage' (asan, asan-cli, tsan)" >&2
      exit 2
      ;;
  esac
done
