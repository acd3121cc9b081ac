#!/usr/bin/env bash
# Builds the libFuzzer targets with clang and runs the object decoder fuzzer for a fixed
# budget. CI calls it; it exits non-zero when the fuzzer finds a crash, a sanitizer report,
# a leak, an input over the memory limit or a hang.
#
#   scripts/run_fuzz.sh                      # 60 s per fuzzer
#   MDIST_FUZZ_SECONDS=600 scripts/run_fuzz.sh
#
# Environment:
#   MDIST_FUZZ_SECONDS    fuzzing time in seconds for each fuzzer (default 60); the safetensors
#                         reader fuzzer runs after the object decoder one, for as long
#   MDIST_FUZZ_BUILD_DIR  build directory (default <repo>/build-fuzz)
#   MDIST_FUZZ_CXX        clang++ to build with (default: clang++, else clang++-NN)
#   MDIST_FUZZ_JOBS       parallel compile jobs (default 2)
#   MDIST_FUZZ_ARTIFACTS  where reproducers of failures go (default <build dir>/fuzz-artifacts)
# Extra arguments are libFuzzer flags (e.g. -seed=1). To rerun a reproducer:
#   ASAN_OPTIONS=detect_leaks=1 build-fuzz/bin/object_decoder_fuzzer <file>
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${MDIST_FUZZ_SECONDS:-60}"
build="${MDIST_FUZZ_BUILD_DIR:-$repo/build-fuzz}"
jobs="${MDIST_FUZZ_JOBS:-2}"
artifacts="${MDIST_FUZZ_ARTIFACTS:-$build/fuzz-artifacts}"

cxx="${MDIST_FUZZ_CXX:-}"
if [[ -z "$cxx" ]]; then
  for candidate in clang++ clang++-19 clang++-18 clang++-17 clang++-16 clang++-15 clang++-14; do
    if command -v "$candidate" > /dev/null; then
      cxx="$candidate"
      break
    fi
  done
fi
if [[ -z "$cxx" ]] || ! command -v "$cxx" > /dev/null; then
  echo "run_fuzz: clang++ not found (libFuzzer needs clang); install clang and libclang-rt-dev," \
    "or set MDIST_FUZZ_CXX" >&2
  exit 2
fi

# The libtorch the rest of the build uses; the install script returns at once when cached.
libtorch="$("$repo/scripts/install_libtorch.sh" | tail -n 1)"

# ccache is picked up by the top-level CMakeLists.txt when it is installed.
mkdir -p "$build"
if ! cmake -S "$repo" -B "$build" -DCMAKE_CXX_COMPILER="$cxx" -DMDIST_LIBTORCH="$libtorch" \
  -DMDIST_BUILD_FUZZ=ON -DMDIST_BUILD_TESTS=OFF -DMDIST_BUILD_BENCH=OFF > "$build/configure.log" 2>&1; then
  cat "$build/configure.log" >&2
  echo "run_fuzz: configuring $build failed" >&2
  exit 2
fi
cmake --build "$build" --target object_decoder_fuzzer object_decoder_seeds safetensors_fuzzer \
  -j "$jobs"

work="$(mktemp -d "${TMPDIR:-/tmp}/mdist-fuzz.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus" "$work/seeds" "$artifacts"
"$build/bin/object_decoder_seeds" "$work/seeds" > /dev/null

# Sanitizer settings, unless the caller sets their own. libtorch is not instrumented, which
# ASan handles since it intercepts malloc and free. LeakSanitizer stays on: libtorch's
# first-use allocations (dispatcher tables, registries) stay reachable from globals and are
# not reported (checked over 10M+ runs with libtorch 2.15); if a libtorch update makes it
# report them, add an LSAN_OPTIONS=suppressions= file for libtorch rather than turning leak
# detection off, since a leak in the decoder on bad input is a bug worth finding.
# UBSan already aborts on the first report (built with -fno-sanitize-recover=all); the
# stack trace says where.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"

# Runs one fuzzer for the budget. New inputs go to the first corpus directory (a temporary
# one); the other directories (generated seeds, committed reproducers, fixtures) are only read.
#   fuzz NAME NEW_CORPUS_DIR READ_ONLY_CORPUS_DIR...
fuzz() {
  local name="$1" corpus_dir="$2"
  shift 2
  local log="$build/$name.log"
  mkdir -p "$corpus_dir"
  set +e
  "$build/bin/$name" -max_total_time="$seconds" -rss_limit_mb=4096 -max_len=65536 \
    -timeout=30 -print_final_stats=1 -artifact_prefix="$artifacts/" "${extra_args[@]}" \
    "$corpus_dir" "$@" > "$log" 2>&1
  local status=$?
  set -e
  local runs corpus
  runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
  corpus="$(find "$corpus_dir" -type f | wc -l)"
  if [[ $status -ne 0 ]]; then
    tail -n 80 "$log" >&2
    echo "run_fuzz: $name FAILED (exit $status) after ${runs:-?} executions;" \
      "reproducer in $artifacts, full log $log" >&2
    exit 1
  fi
  echo "run_fuzz: $name OK: ${runs:-?} executions in ${seconds} s, $corpus new corpus units"
}

extra_args=("$@")
fuzz object_decoder_fuzzer "$work/corpus" "$work/seeds" "$repo/fuzz/corpus/object_decoder"
# The safetensors reader: same budget, seeded with the test fixtures (files written by the
# official safetensors library).
fuzz safetensors_fuzzer "$work/safetensors_corpus" "$repo/tests/hf/fixtures"
