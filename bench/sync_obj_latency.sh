#!/usr/bin/env bash
# Median latency of syncing one value across 2 ranks over Gloo, mdist (C++) beside PyTorch
# (Python, the same torch version) on this machine, as one table with ratios.
#   bench/sync_obj_latency.sh [calls=1000] [ranks=2]
# Needs a build (scripts/setup.sh) and creates a bench-only venv with torch on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
calls="${1:-1000}"
ranks="${2:-2}"
cache="${MDIST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mdist}"
venv="${MDIST_BENCH_VENV:-$cache/bench-venv}" # MDIST_BENCH_VENV: an existing venv with torch (a GPU machine's)
if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import torch, numpy" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q -r bench/requirements.txt
fi
cmake --build build --target sync_obj_latency mdistrun >/dev/null
export OMP_NUM_THREADS=1
results="$(mktemp)"
trap 'rm -f "$results"' EXIT
build/bin/mdistrun --nproc-per-node "$ranks" build/bin/sync_obj_latency "$calls" | sed 's/^\[rank0\]: //' >>"$results"
"$venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node "$ranks" \
  bench/sync_obj_latency.py "$calls" 2>/dev/null >>"$results"
"$venv/bin/python" - "$results" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
by = {(r["impl"], r["op"]): r for r in rows}
py_obj = by[("torch.distributed (Python)", "all_gather_object(float) + max")]["median_us"]
py_raw = by[("torch.distributed (Python)", "all_gather_into_tensor(float[1])")]["median_us"]
print(f"Sync one value across {rows[0]['world']} ranks (Gloo, loopback), {rows[0]['calls']} calls each")
print(f"{'implementation':<28} {'operation':<34} {'median us':>10} {'p10':>8} {'p90':>8} {'vs Python obj':>14} {'vs Python raw':>14}")
for r in rows:
    print(f"{r['impl']:<28} {r['op']:<34} {r['median_us']:>10.1f} {r['p10_us']:>8.1f} {r['p90_us']:>8.1f} "
          f"{r['median_us'] / py_obj:>14.2f} {r['median_us'] / py_raw:>14.2f}")
PY
