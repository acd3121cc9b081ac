#!/usr/bin/env bash
# `mdist quantize` beside modelopt 0.47 (`mtq.quantize` + `export_hf_checkpoint`,
# bench/quantize_modelopt.py) on the same model, data and threads, one process each: wall time
# and peak RSS of the whole command (load, held-out loss before, calibration, held-out loss of
# the fake-quantized model, export), per format, as one markdown table with C++/Python ratios.
# This machine's speed drifts, so each format alternates the sides ROUNDS times (C++, Python,
# C++, ...) and the ratios pair each C++ run with the Python run after it: median [min, max].
#   bench/quantize.sh
# The model: a random-initialised LlamaForCausalLM written by the Python side (HIDDEN 512,
# LAYERS 12, INTERMEDIATE 1536, vocab 256: 41.6 M parameters, fp32 safetensors), data: the
# embedded Macbeth as bytes, the first 90 % for calibration, the rest held out.
# Environment: BUILD_DIR (build), FORMATS ("fp8 int8_sq int4_awq nvfp4"), ROUNDS (3), THREADS (1),
# SEQ_LEN (256), CALIB (32 sequences), EVAL (8 sequences), BATCH (4), HIDDEN, LAYERS,
# INTERMEDIATE, RUN_TIMEOUT (900 s per run), MDIST_BENCH_VENV (an existing venv with torch,
# transformers and nvidia-modelopt), MDIST_CACHE, SKIP_BUILD=1.
set -uo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build}"
formats="${FORMATS:-fp8 int8_sq int4_awq nvfp4}"
rounds="${ROUNDS:-3}"
threads="${THREADS:-1}"
seq_len="${SEQ_LEN:-256}"
calib="${CALIB:-32}"
eval_n="${EVAL:-8}"
batch="${BATCH:-4}"
run_timeout="${RUN_TIMEOUT:-900}"
cache="${MDIST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mdist}"
venv="${MDIST_BENCH_VENV:-$cache/bench-venv}"
began=$SECONDS
load_before="$(cut -d' ' -f1-3 /proc/loadavg)"

if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  cmake --build "$build" --target mdist_cli >/dev/null || { echo "build failed in $build" >&2; exit 1; }
fi
[[ -x "$build/bin/mdist" ]] || { echo "no $build/bin/mdist (build first: scripts/setup.sh)" >&2; exit 1; }
# shellcheck source=bench/bench_venv.sh
source bench/bench_venv.sh
ensure_bench_venv "torch, transformers, modelopt.torch.quantization"
[[ $python_ok -eq 1 ]] || { echo "the Python side needs the bench venv ($venv)" >&2; exit 1; }

export OMP_NUM_THREADS="$threads"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
results="$work/results.jsonl"
model="$work/model"
"$venv/bin/python" bench/quantize_modelopt.py make --out "$model" --hidden "${HIDDEN:-512}" \
  --layers "${LAYERS:-12}" --intermediate "${INTERMEDIATE:-1536}" >"$work/make.json" ||
  { echo "making the model failed" >&2; exit 1; }
python3 - data/corpus/macbeth.txt "$work/calib.txt" "$work/eval.txt" <<'PY'
import sys
data = open(sys.argv[1], "rb").read()
cut = len(data) * 9 // 10
open(sys.argv[2], "wb").write(data[:cut])
open(sys.argv[3], "wb").write(data[cut:])
PY

# record IMPL FORMAT ROUND LOG TIMES REPORT: one JSON line from /usr/bin/time's "%e %M" and the
# side's own report, a JSON file (mdist: quantize.json, whose per-module amax can be megabytes;
# Python: its printed line).
record() {
  IMPL="$1" FMT="$2" ROUND="$3" LOG="$4" TIMES="$5" REPORT="$6" python3 - >>"$results" <<'PY'
import json, os
row = {"impl": os.environ["IMPL"], "format": os.environ["FMT"], "round": int(os.environ["ROUND"])}
times = open(os.environ["TIMES"]).read().split() if os.path.exists(os.environ["TIMES"]) else []
report = os.environ["REPORT"]
if len(times) < 2 or not os.path.isfile(report) or os.path.getsize(report) == 0:
    lines = [l for l in open(os.environ["LOG"]).read().splitlines() if l.strip()]
    why = next((l for l in lines if "error" in l.lower()), lines[-1] if lines else "no output")
    row["error"] = why[:200]
else:
    r = json.load(open(report))
    row.update(wall_s=float(times[0]), peak_rss_mib=int(times[1]) / 1024.0,
               loss_before=r["loss_before"], loss_after=r["loss_after"],
               seconds=r["seconds"])
print(json.dumps(row))
PY
}

run_cpp() {
  local fmt="$1" round="$2" out="$work/cpp-$1-$2" log="$work/cpp-$1-$2.log" t="$work/cpp-$1-$2.time"
  rm -f "$t"
  timeout --kill-after=30 "$run_timeout" /usr/bin/time -o "$t" -f '%e %M' "$build/bin/mdist" \
    quantize --model "$model" --format "$fmt" --data "$work/calib.txt" --eval-data "$work/eval.txt" \
    --seq-len "$seq_len" --calib-sequences "$calib" --eval-sequences "$eval_n" \
    --batch-size "$batch" --out "$out" >"$log" 2>&1
  record "mdist (C++)" "$fmt" "$round" "$log" "$t" "$out/quantize.json"
  rm -rf "$out"
}

run_py() {
  local fmt="$1" round="$2" out="$work/py-$1-$2" log="$work/py-$1-$2.log" t="$work/py-$1-$2.time"
  rm -f "$t"
  timeout --kill-after=30 "$run_timeout" /usr/bin/time -o "$t" -f '%e %M' "$venv/bin/python" \
    bench/quantize_modelopt.py run --model "$model" --format "$fmt" --data "$work/calib.txt" \
    --eval-data "$work/eval.txt" --seq-len "$seq_len" --calib-sequences "$calib" \
    --eval-sequences "$eval_n" --batch-size "$batch" --threads "$threads" --out "$out" >"$log" 2>&1
  grep '^{' "$log" | tail -n 1 >"$work/py-report.json"
  record "modelopt (Python)" "$fmt" "$round" "$log" "$t" "$work/py-report.json"
  rm -rf "$out"
}

for fmt in $formats; do
  for ((round = 1; round <= rounds; ++round)); do
    run_cpp "$fmt" "$round"
    run_py "$fmt" "$round"
    echo "$fmt round $round: $((SECONDS - began)) s" >&2
  done
done

python3 - "$results" "$work/make.json" "$model" "$threads" "$seq_len" "$calib" "$eval_n" \
  "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)" "$((SECONDS - began))" <<'PY'
import json, os, statistics, struct, sys
(path, make, model, threads, seq_len, calib, eval_n, load_before, load_after, elapsed) = sys.argv[1:]
rows = [json.loads(l) for l in open(path) if l.startswith("{")]
params = json.load(open(make))["parameters"]
st = os.path.join(model, "model.safetensors")
header = json.loads(open(st, "rb").read(8 + struct.unpack("<Q", open(st, "rb").read(8))[0])[8:])
largest = max((v["data_offsets"][1] - v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__")
model_mib = os.path.getsize(st) / 2**20
print(f"`mdist quantize` vs modelopt 0.47 (mtq.quantize + export_hf_checkpoint), one process, "
      f"{threads} thread(s); LlamaForCausalLM {params / 1e6:.1f} M parameters, fp32 "
      f"({model_mib:.0f} MiB, largest tensor {largest / 2**20:.1f} MiB); calibration {calib} x {seq_len} "
      f"tokens, held-out {eval_n} x {seq_len}, before and after")
print()
print("| format | mdist wall s | modelopt wall s | wall C++/Py | mdist peak RSS MiB | modelopt peak RSS MiB "
      "| RSS C++/Py | loss before → after (mdist) | (modelopt) |")
print("|---|---:|---:|---:|---:|---:|---:|---|---|")
def spread(values, fmt):
    if not values:
        return "FAILED"
    values = sorted(values)
    return f"{fmt.format(values[(len(values) - 1) // 2])} [{fmt.format(values[0])}, {fmt.format(values[-1])}]"
CPP, PY = "mdist (C++)", "modelopt (Python)"
failures = []
for fmt in dict.fromkeys(r["format"] for r in rows):
    side = {impl: {r["round"]: r for r in rows if r["format"] == fmt and r["impl"] == impl and "error" not in r}
            for impl in (CPP, PY)}
    failures += [f"{r['impl']} {fmt} round {r['round']}: {r['error']}" for r in rows
                 if r["format"] == fmt and "error" in r]
    pairs = sorted(set(side[CPP]) & set(side[PY]))
    cells = [fmt]
    cells.append(spread([r["wall_s"] for r in side[CPP].values()], "{:.1f}"))
    cells.append(spread([r["wall_s"] for r in side[PY].values()], "{:.1f}"))
    cells.append(spread([side[CPP][k]["wall_s"] / side[PY][k]["wall_s"] for k in pairs], "{:.2f}"))
    cells.append(spread([r["peak_rss_mib"] for r in side[CPP].values()], "{:.0f}"))
    cells.append(spread([r["peak_rss_mib"] for r in side[PY].values()], "{:.0f}"))
    cells.append(spread([side[CPP][k]["peak_rss_mib"] / side[PY][k]["peak_rss_mib"] for k in pairs], "{:.2f}"))
    for impl in (CPP, PY):
        r = next(iter(side[impl].values()), None)
        cells.append(f"{r['loss_before']:.5f} → {r['loss_after']:.5f}" if r else "FAILED")
    print("| " + " | ".join(cells) + " |")
print()
print("phase seconds (median over rounds): " + "; ".join(
    f"{impl.split()[0]} {fmt}: " + ", ".join(
        f"{k} {statistics.median(r['seconds'][k] for r in rows if r['impl'] == impl and r['format'] == fmt and 'error' not in r):.1f}"
        for k in next(r for r in rows if r["impl"] == impl and r["format"] == fmt and "error" not in r)["seconds"])
    for fmt in dict.fromkeys(r["format"] for r in rows) for impl in (CPP, PY)
    if any(r["impl"] == impl and r["format"] == fmt and "error" not in r for r in rows)))
for f in failures:
    print("FAILED " + f)
print(f"load average before {load_before}, after {load_after}; whole run: {elapsed} s")
PY
