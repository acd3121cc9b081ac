#!/usr/bin/env bash
# Encode throughput, single-threaded, of mdist::hf::Tokenizer beside Hugging Face tokenizers
# (Rust, through Python) on the same tokenizer.json and corpus: the fixture corpus of
# tests/hf/tokenizer repeated to ~SIZE_MB, per line and as one whole text, for each family.
# Runs alternate C++ and Python, PAIRS times; the table gives the median/min/max ratio.
#   bench/tokenizer_encode.sh [PAIRS=3] [SIZE_MB=4] [FAMILIES="gpt2 llama3 qwen2 llama2 mistral"]
set -uo pipefail
cd "$(dirname "$0")/.."
pairs="${1:-3}"
size_mb="${2:-4}"
families="${3:-gpt2 llama3 qwen2 llama2 mistral}"
build="${BUILD_DIR:-build}"
cache="${MDIST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mdist}"
venv="$cache/bench-venv"
source bench/bench_venv.sh
ensure_bench_venv tokenizers
cmake --build "$build" --target tokenizer_encode >/dev/null || { echo "build failed in $build" >&2; exit 1; }
work="$(mktemp -d "${TMPDIR:-/tmp}/mdist-tok-bench.XXXXXX")"
trap 'rm -rf "$work"' EXIT
corpus="$work/corpus.txt"
fixtures=tests/hf/tokenizer/fixtures
while [[ $(stat -c %s "$corpus" 2>/dev/null || echo 0) -lt $((size_mb * 1000000)) ]]; do
  cat "$fixtures/corpus.txt" >>"$corpus"
done
results="$work/results.jsonl"
for family in $families; do
  for mode in lines whole; do
    for _ in $(seq "$pairs"); do
      "$build/bin/tokenizer_encode" "$fixtures/$family" "$corpus" "$mode" |
        sed "s/^{/{\"family\": \"$family\", /" >>"$results"
      if [[ $python_ok == 1 ]]; then
        "$venv/bin/python" bench/tokenizer_encode.py "$fixtures/$family" "$corpus" "$mode" |
          sed "s/^{/{\"family\": \"$family\", /" >>"$results"
      fi
    done
  done
done
python3 - "$results" "$(stat -c %s "$corpus")" "$pairs" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
print(f"Encode throughput, one thread, corpus {int(sys.argv[2]) / 1e6:.1f} MB, {sys.argv[3]} alternating pairs")
print(f"{'family':<10} {'mode':<6} {'C++ MB/s':>9} {'Rust MB/s':>10} {'C++ Mtok/s':>11} {'Rust Mtok/s':>12} "
      f"{'ratio median':>13} {'min':>6} {'max':>6}")
keys = []
for r in rows:
    if (r["family"], r["mode"]) not in keys:
        keys.append((r["family"], r["mode"]))
for family, mode in keys:
    cpp = [r for r in rows if r["family"] == family and r["mode"] == mode and r["impl"].startswith("mdist")]
    py = [r for r in rows if r["family"] == family and r["mode"] == mode and not r["impl"].startswith("mdist")]
    if not py:
        print(f"{family:<10} {mode:<6} {statistics.median(r['mb_per_s'] for r in cpp):>9.2f}  (no Python rows)")
        continue
    ratios = [c["mb_per_s"] / p["mb_per_s"] for c, p in zip(cpp, py)]
    print(f"{family:<10} {mode:<6} {statistics.median(r['mb_per_s'] for r in cpp):>9.2f} "
          f"{statistics.median(r['mb_per_s'] for r in py):>10.2f} "
          f"{statistics.median(r['tokens_per_s'] for r in cpp) / 1e6:>11.2f} "
          f"{statistics.median(r['tokens_per_s'] for r in py) / 1e6:>12.2f} "
          f"{statistics.median(ratios):>13.2f} {min(ratios):>6.2f} {max(ratios):>6.2f}")
print("ratio = C++ MB/s / Rust MB/s of the same pair (> 1: C++ faster)")
PY
