#!/usr/bin/env bash
# Generation with the KV cache, one thread, batch 1, greedy: mdist::hf::generate
# (bench/generate.cpp) beside transformers' model.generate with its DynamicCache
# (bench/generate.py, the same torch version), on the same saved Llama-shaped model (~19 M
# parameters, written once by generate.py --write) and prompt. Rounds alternate C++ and
# Python ROUNDS times; the table gives tokens/s (median over rounds) and the median/min/max of
# the per-round ratio, then the mean time of one decoding step at growing context lengths
# (flat with a cache; the old `mdist generate` recomputed the whole sequence per token).
#   bench/generate.sh [NEW=512] [PROMPT=16]
# Environment: BUILD_DIR (default build), ROUNDS (3), MDIST_BENCH_VENV (a venv with torch and
# transformers; default the bench venv, created from bench/requirements.txt on first use).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
new_tokens="${1:-512}"
prompt="${2:-16}"
rounds="${ROUNDS:-3}"
build="${BUILD_DIR:-build}"
cache="${MDIST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mdist}"
venv="${MDIST_BENCH_VENV:-$cache/bench-venv}"
source bench/bench_venv.sh
ensure_bench_venv "torch, transformers"
[[ $python_ok == 1 ]] || { echo "generate.sh needs the Python side to write the model" >&2; exit 1; }
cmake --build "$build" --target generate_bench >/dev/null || { echo "build failed in $build" >&2; exit 1; }
work="$(mktemp -d "${TMPDIR:-/tmp}/mdist-generate-bench.XXXXXX")"
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
"$venv/bin/python" bench/generate.py --write "$work/model" || exit 1
results="$work/results.jsonl"
for _ in $(seq "$rounds"); do
  "$build/bin/generate_bench" "$work/model" "$prompt" "$new_tokens" >>"$results"
  "$venv/bin/python" bench/generate.py "$work/model" "$prompt" "$new_tokens" >>"$results"
done
python3 - "$results" "$rounds" "$prompt" "$new_tokens" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
cpp = [r for r in rows if r["impl"] == "mdist"]
py = [r for r in rows if r["impl"] != "mdist"]
print(f"Greedy generation, 1 thread, batch 1, prompt {sys.argv[3]} + {sys.argv[4]} new tokens, "
      f"{sys.argv[2]} alternating rounds ({py[0]['impl'] if py else 'no Python rows'})")
ratios = [c["tokens_per_s"] / p["tokens_per_s"] for c, p in zip(cpp, py)]
print(f"tokens/s   mdist {statistics.median(r['tokens_per_s'] for r in cpp):8.1f}   "
      f"transformers {statistics.median(r['tokens_per_s'] for r in py):8.1f}   ratio median "
      f"{statistics.median(ratios):.2f} min {min(ratios):.2f} max {max(ratios):.2f}")
print(f"{'context':>8} {'mdist ms/token':>15} {'transformers ms/token':>22}")
for key in sorted({k for r in rows for k in r if k.startswith("step_ms_")}, key=lambda k: int(k[8:])):
    print(f"{key[8:]:>8} {statistics.median(r[key] for r in cpp if key in r):>15.3f} "
          f"{statistics.median(r[key] for r in py if key in r):>22.3f}")
print("ratio = mdist tokens/s / transformers tokens/s of the same round (> 1: mdist faster)")
PY
