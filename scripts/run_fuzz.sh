#!/usr/bin/env bash
# Builds the libFuzzer targets with clang and runs each fuzzer (object decoder, safetensors
# reader, tokenizer) for a fixed budget, seeded with the corpus kept in the repository
# (fuzz/corpus/<target>/). CI calls it; it exits non-zero when a fuzzer finds a crash, a
# sanitizer report, a leak, an input over the memory limit or a hang.
#
#   scripts/run_fuzz.sh                      # 60 s per fuzzer, the committed corpus unchanged
#   scripts/fuzz_long.sh                     # 10 min per fuzzer, new inputs merged back
#
# Environment:
#   MDIST_FUZZ_SECONDS    fuzzing time in seconds for each fuzzer (default 60); the safetensors
#                         reader and tokenizer fuzzers run after the object decoder one, for as long
#   MDIST_FUZZ_BUILD_DIR  build directory (default <repo>/build-fuzz)
#   MDIST_FUZZ_CXX        clang++ to build with (default: clang++, else clang++-NN)
#   MDIST_FUZZ_JOBS       parallel compile jobs (default 2)
#   MDIST_FUZZ_ARTIFACTS  where reproducers of failures go (default <build dir>/fuzz-artifacts)
#   MDIST_FUZZ_MERGE      1: after a clean run, merge the inputs that add coverage into
#                         fuzz/corpus/<target>/ (libFuzzer -merge=1; scripts/fuzz_long.sh sets it)
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
  tokenizer_fuzzer -j "$jobs"

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
# one); the other directories (the committed corpus, generated seeds, fixtures) are only read.
# With MDIST_FUZZ_MERGE=1 the new inputs that reach coverage the committed corpus does not are
# then merged into it: -merge=1 keeps everything already there (regress-* inputs stay even
# when they add no coverage) and adds, of the new inputs, the fewest and smallest that cover
# the new edges, so the corpus grows only as far as it is worth.
#   fuzz NAME COMMITTED_CORPUS_DIR NEW_CORPUS_DIR READ_ONLY_CORPUS_DIR...
fuzz() {
  local name="$1" committed="$2" corpus_dir="$3"
  shift 3
  local log="$build/$name.log"
  mkdir -p "$corpus_dir"
  set +e
  "$build/bin/$name" -max_total_time="$seconds" -rss_limit_mb=4096 -max_len=65536 \
    -timeout=30 -print_final_stats=1 -artifact_prefix="$artifacts/" "${extra_args[@]}" \
    "$corpus_dir" "$committed" "$@" > "$log" 2>&1
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
  if [[ "${MDIST_FUZZ_MERGE:-0}" == 1 ]]; then
    local before after
    before="$(find "$committed" -type f | wc -l)"
    # -use_counters=0: an input is kept for reaching an edge the corpus never reached, not
    # for reaching a known one more often (hit-count buckets would keep hundreds of inputs
    # differing only in how many JSON keys or vector elements they hold).
    if ! "$build/bin/$name" -merge=1 -use_counters=0 -rss_limit_mb=4096 -max_len=65536 -timeout=30 \
      "$committed" "$corpus_dir" > "$build/$name.merge.log" 2>&1; then
      tail -n 40 "$build/$name.merge.log" >&2
      echo "run_fuzz: merging $name's new inputs into $committed failed" >&2
      exit 1
    fi
    after="$(find "$committed" -type f | wc -l)"
    echo "run_fuzz: $name: merged $((after - before)) inputs into $committed" \
      "($after files, $(find "$committed" -type f -printf '%s\n' | awk '{ s += $1 } END { print s }')" \
      "bytes); review and commit them"
  fi
}

extra_args=("$@")
fuzz object_decoder_fuzzer "$repo/fuzz/corpus/object_decoder" "$work/corpus" "$work/seeds"
# The safetensors reader: same budget, seeded with its committed corpus and the test fixtures
# (files written by the official safetensors library).
fuzz safetensors_fuzzer "$repo/fuzz/corpus/safetensors" "$work/safetensors_corpus" \
  "$repo/tests/hf/fixtures"
# The tokenizer (encode, decode and the StreamEncoder of every fixture family on arbitrary bytes):
# seeded with its committed corpus and each line of the fixtures' multilingual corpus.
mkdir -p "$work/tokenizer_seeds"
split -l 1 -a 3 "$repo/tests/hf/tokenizer/fixtures/corpus.txt" "$work/tokenizer_seeds/line-"
fuzz tokenizer_fuzzer "$repo/fuzz/corpus/tokenizer" "$work/tokenizer_corpus" "$work/tokenizer_seeds"
