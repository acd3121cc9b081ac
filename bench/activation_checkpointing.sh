#!/usr/bin/env bash
# Activation checkpointing's memory and time on one process: a ~134 M-parameter Llama-style
# model (hidden 768, 12 layers, vocab 32000, random init, fp32, AdamW), batch 2 x 512 tokens,
# trained with --activation-checkpointing none and full, alternating the modes ROUNDS times
# (a fresh process each), each run one unmeasured step then STEPS measured ones. Prints each
# run's JSON line, then per mode the median/min/max of the peak RSS, its activation part (peak
# minus the resident size before the step: weights, gradients and AdamW state) and step time.
#   bench/activation_checkpointing.sh
# Environment: BUILD_DIR (default build), ROUNDS (3), STEPS (2), BATCH (2), SEQ (512).
# MALLOC_MMAP_THRESHOLD_ is fixed at 64 KiB so that freed activations go back to the kernel and
# do not hide in glibc's heap (its dynamic threshold would keep blocks up to 32 MiB resident).
set -uo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build}"
rounds="${ROUNDS:-3}"
steps="${STEPS:-2}"
cmake --build "$build" --target activation_checkpointing_bench >/dev/null ||
  { echo "build failed in $build" >&2; exit 1; }
results="$(mktemp)"
trap 'rm -f "$results"' EXIT
for ((round = 1; round <= rounds; ++round)); do
  for mode in none full; do
    MALLOC_MMAP_THRESHOLD_=65536 "$build/bin/activation_checkpointing_bench" "$mode" \
      "${BATCH:-2}" "${SEQ:-512}" "$steps" | tee -a "$results"
  done
done
python3 - "$results" <<'PY'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
def row(values):
    return f"{statistics.median(values):9.1f} {min(values):9.1f} {max(values):9.1f}"
print(f"{len(runs)} runs, {runs[0]['parameters'] / 1e6:.1f} M parameters, {runs[0]['tokens']} tokens per step")
print(f"{'mode':6} {'what':22} {'median':>9} {'min':>9} {'max':>9}")
by_mode = {}
for mode in ("none", "full"):
    mine = [r for r in runs if r["mode"] == mode]
    steps = [s for r in mine for s in r["step_s"]]
    by_mode[mode] = (statistics.median(r["activation_mib"] for r in mine), statistics.median(steps))
    print(f"{mode:6} {'peak RSS (MiB)':22} {row([r['peak_mib'] for r in mine])}")
    print(f"{mode:6} {'activations (MiB)':22} {row([r['activation_mib'] for r in mine])}")
    print(f"{mode:6} {'step (s)':22} {row(steps)}")
(a_none, t_none), (a_full, t_full) = by_mode["none"], by_mode["full"]
print(f"full / none: activations {a_full / a_none:.2f}x, step time {t_full / t_none:.2f}x (medians)")
PY
