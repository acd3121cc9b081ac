#!/usr/bin/env bash
# Developer fuzzing: each fuzzer for 10 minutes (one after the other), seeded with the corpus
# in the repository, whose new interesting inputs are then merged back into
# fuzz/corpus/<target>/ (libFuzzer -merge=1: only inputs that add coverage, the smallest ones).
# Review `git status fuzz/corpus` afterwards and commit what it added; CI's short run
# (scripts/run_fuzz.sh) starts from that corpus.
#
#   scripts/fuzz_long.sh                      # 10 min per fuzzer
#   MDIST_FUZZ_SECONDS=1800 scripts/fuzz_long.sh -seed=7
#
# A crash stops the run with its reproducer in build-fuzz/fuzz-artifacts/; once it is fixed,
# copy the reproducer to fuzz/corpus/<target>/regress-<what> (see fuzz/README.md). Other
# settings and arguments are those of scripts/run_fuzz.sh.
set -euo pipefail

MDIST_FUZZ_SECONDS="${MDIST_FUZZ_SECONDS:-600}" MDIST_FUZZ_MERGE=1 \
  exec "$(dirname "${BASH_SOURCE[0]}")/run_fuzz.sh" "$@"
