#!/usr/bin/env bash
# `mdist train` on the embedded default (data/default Llama, byte-level Macbeth) on 1 and 2
# ranks: tokens/s and peak RSS per rank of the C++ job (build/bin/mdist through mdistrun)
# beside the same training loop written with transformers + PyTorch FSDP2 (bench/train_cli.py
# through torchrun, the same torch version): same model and initialisation style, data, global
# batch, schedule and steps, as one markdown table with C++/Python ratios. This machine's speed
# drifts, so each rank count alternates the two sides ROUNDS times (C++, Python, C++, ...) and
# the tokens/s ratio is paired per round: median [min, max] over the rounds.
#   bench/train_cli.sh [steps=60]
# Environment: BUILD_DIR (default build), RANKS ("1 2"), ROUNDS (3), WARMUP (5 steps left out of the
# tokens/s median), SEQ_LEN (128), GLOBAL_BATCH (16 sequences, split over the ranks), LR (3e-3),
# LR_WARMUP (30 steps), SEED (1234), PARAM_DTYPE (fp32, or bf16: both sides with FSDP2's bf16
# mixed precision, mdist train --param-dtype bf16), RUN_TIMEOUT (600 s per run, so that a hung job becomes a
# failed row), MDIST_CACHE (where the bench venv lives), SKIP_BUILD=1 (use the binaries in
# BUILD_DIR as they are), QAT=1 (below).
# QAT=1: instead, the quantization-aware training and distillation rows (issue 29) on the same
# model, data, schedule and threads, per round C++ then Python for each of VARIANTS ("plain fp8
# int8 qad_fp8"): `mdist train --quant fp8|int8` (QAT) and `--quant fp8 --teacher` (QAD) vs
# modelopt 0.47's mtq.quantize + the same loop (bench/train_qat.py), both from one seeded
# transformers initialisation and in mdist's data order (so the first losses agree); step time
# without calibration, calibration time separately, mdist QAT step ÷ its plain step; fp32 only;
# CALIB_SEQUENCES (64). See bench/train_cli_qat.sh. E.g. QAT=1 RANKS=2 bench/train_cli.sh 30
# Needs a build (scripts/setup.sh) and creates a bench-only venv with torch and transformers
# (bench/requirements.txt) on first use.
set -uo pipefail
cd "$(dirname "$0")/.."
steps="${1:-60}"
build="${BUILD_DIR:-build}"
ranks="${RANKS:-1 2}"
rounds="${ROUNDS:-3}"
warmup="${WARMUP:-5}"
seq_len="${SEQ_LEN:-128}"
batch="${GLOBAL_BATCH:-16}"
lr="${LR:-3e-3}"
lr_warmup="${LR_WARMUP:-30}"
seed="${SEED:-1234}"
param_dtype="${PARAM_DTYPE:-fp32}" # bf16: both sides train with FSDP2's bf16 mixed precision
[[ "$param_dtype" == fp32 || "$param_dtype" == bf16 ]] ||
  { echo "PARAM_DTYPE is fp32 or bf16, not $param_dtype" >&2; exit 1; }
dtype_flag=()
[[ "$param_dtype" == bf16 ]] && dtype_flag=(--param-dtype bf16)
run_timeout="${RUN_TIMEOUT:-600}"
cache="${MDIST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mdist}"
venv="${MDIST_BENCH_VENV:-$cache/bench-venv}" # MDIST_BENCH_VENV: an existing venv with torch (a GPU machine's)
began=$SECONDS
[[ "$steps" =~ ^[0-9]+$ && "$warmup" =~ ^[0-9]+$ && $steps -gt $warmup ]] ||
  { echo "steps ($steps) must be a number above WARMUP ($warmup)" >&2; exit 1; }
load_before="$(cut -d' ' -f1-3 /proc/loadavg)"

if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  cmake --build "$build" --target mdist_cli mdistrun >/dev/null ||
    { echo "build failed in $build" >&2; exit 1; }
fi
[[ -x "$build/bin/mdist" && -x "$build/bin/mdistrun" ]] ||
  { echo "no $build/bin/mdist or $build/bin/mdistrun (build first: scripts/setup.sh)" >&2; exit 1; }
# shellcheck source=bench/bench_venv.sh
source bench/bench_venv.sh
if [[ "${QAT:-0}" == 1 ]]; then
  ensure_bench_venv "torch, numpy, transformers, modelopt.torch.quantization"
else
  ensure_bench_venv "torch, numpy, transformers"
fi

# One thread per rank on both sides: the ranks share this machine's cores, and torch would
# otherwise start a full thread pool in every rank.
export OMP_NUM_THREADS=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
results="$work/results.jsonl"

# fail IMPL WORLD RC LOG [WHY]: appends a JSON line describing a failed run.
fail() {
  local impl="$1" world="$2" rc="$3" log="$4" why="${5:-}"
  if [[ -z "$why" ]]; then
    # The first line that names the cause: our own "bench:" errors, an exception's message,
    # mdist's "error:" lines, not the launchers' summaries of which rank failed.
    why="$(grep -E 'bench:|[A-Za-z]+(Error|Exception)\b:|error:' "$log" |
      grep -vE 'ChildFailedError|elastic' | head -n 1 | sed 's/^\[rank[0-9]*\]: //')"
    [[ -z "$why" ]] && why="$(tail -n 1 "$log")"
  fi
  echo "---- $impl on $world ranks failed (exit $rc); last lines of its output:" >&2
  tail -n 15 "$log" >&2
  IMPL="$impl" WORLD="$world" RC="$rc" WHY="$why" python3 -c '
import json, os
why = "exit %s: %s" % (os.environ["RC"], os.environ["WHY"][:160])
print(json.dumps({"impl": os.environ["IMPL"], "world": int(os.environ["WORLD"]), "error": why}))
' >>"$results"
}

# launch LOG COMMAND...: runs one job under the timeout; returns its exit status.
launch() {
  local log="$1"
  shift
  # Both launchers pass SIGTERM on to their ranks.
  timeout --kill-after=30 "$run_timeout" "$@" >"$log" 2>&1
  local rc=$?
  [[ $rc -eq 124 ]] && echo "bench: timed out after $run_timeout s" >>"$log"
  return $rc
}

# The C++ job: its metrics.jsonl gives the row (median tokens/s after the warm-up steps, the
# peak RSS of each rank at the last step, the first and last loss).
run_cpp() {
  local world="$1" round="$2" impl="mdist (C++)" log="$work/cpp-$1-$2.log" out="$work/cpp-$1-$2-out"
  local start=$SECONDS
  launch "$log" "$build/bin/mdistrun" --nproc-per-node "$world" "$build/bin/mdist" train \
    --steps "$steps" --seq-len "$seq_len" --global-batch "$batch" --lr "$lr" \
    --warmup "$lr_warmup" --seed "$seed" --save-every 0 --eval-every 0 --overwrite --out "$out" \
    "${dtype_flag[@]}"
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    fail "$impl" "$world" "$rc" "$log"
  else
    local line
    if line="$(python3 - "$out/metrics.jsonl" "$world" "$warmup" "$steps" "$round" 2>&1 <<'PY'
import json, statistics, sys
path, world, warmup, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
round_ = int(sys.argv[5])
rows = [json.loads(line) for line in open(path) if line.strip()]
if len(rows) != steps:
    raise SystemExit(f"bench: metrics.jsonl has {len(rows)} steps, expected {steps}")
if len(rows[-1]["peak_rss_mib"]) != world:
    raise SystemExit(f"bench: peak_rss_mib has {len(rows[-1]['peak_rss_mib'])} ranks, "
                     f"expected {world}")
print(json.dumps({"impl": "mdist (C++)", "world": world, "round": round_, "steps": len(rows),
                  "tokens_per_s": statistics.median_low(r["tokens_per_s"] for r in rows[warmup:]),
                  "peak_rss_mib": rows[-1]["peak_rss_mib"],
                  "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"],
                  "last_lr": rows[-1]["lr"]}))
PY
)"; then
      echo "$line" >>"$results"
    else
      fail "$impl" "$world" "$rc" "$log" "$(echo "$line" | tail -n 1)"
    fi
  fi
  echo "$impl, $world rank(s): $((SECONDS - start)) s" >&2
}

run_py() {
  local world="$1" round="$2" impl="transformers + torch FSDP2 (Python)" log="$work/py-$1-$2.log"
  local start=$SECONDS
  if [[ $python_ok -ne 1 ]]; then
    echo '{"impl": "'"$impl"'", "world": '"$world"', "error": "no bench venv"}' >>"$results"
    return
  fi
  launch "$log" "$venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node "$world" \
    bench/train_cli.py --steps "$steps" --warmup-steps "$warmup" --seq-len "$seq_len" \
    --global-batch "$batch" --lr "$lr" --warmup "$lr_warmup" --seed "$seed" \
    --param-dtype "$param_dtype"
  local rc=$?
  local line
  line="$(sed 's/^\[rank0\]: //' "$log" | grep '^{' | tail -n 1)"
  if [[ $rc -ne 0 || -z "$line" ]]; then
    fail "$impl" "$world" "$rc" "$log"
  else
    echo "$line" | python3 -c 'import json, sys; r = json.load(sys.stdin); r["round"] = int(sys.argv[1]); print(json.dumps(r))' "$round" >>"$results"
  fi
  echo "$impl, $world rank(s): $((SECONDS - start)) s" >&2
}

if [[ "${QAT:-0}" == 1 ]]; then
  # shellcheck source=bench/train_cli_qat.sh
  source bench/train_cli_qat.sh
  exit 0
fi

for world in $ranks; do
  for ((round = 1; round <= rounds; ++round)); do
    run_cpp "$world" "$round"
    run_py "$world" "$round"
  done
done

python3 - "$results" "$steps" "$warmup" "$batch" "$seq_len" "$lr" "$lr_warmup" "$seed" \
  "$(getconf _NPROCESSORS_ONLN)" "$((SECONDS - began))" "$load_before" \
  "$(cut -d' ' -f1-3 /proc/loadavg)" "$param_dtype" <<'PY'
import json, sys
(path, steps, warmup, batch, seq_len, lr, lr_warmup, seed, cores, elapsed, load_before,
 load_after, param_dtype) = sys.argv[1:]
rows = [json.loads(line) for line in open(path) if line.startswith("{")]
CPP, PY = "mdist (C++)", "transformers + torch FSDP2 (Python)"
py_ok = [r for r in rows if r["impl"] == PY and "error" not in r]
params = py_ok[0]["params"] if py_ok else "?"
versions = (f"torch {py_ok[0]['torch']}, transformers {py_ok[0]['transformers']}, "
            f"attention {py_ok[0]['attn']}" if py_ok else "")
print(f"`mdist train` on the default model (data/default: Llama, {params} parameters, 4 layers, "
      f"hidden 128, vocab 256, fp32 weights, " + ("fp32 compute" if param_dtype == "fp32" else
      "bf16 mixed precision: param_dtype bf16, reduce_dtype fp32") +
      ") and data (Macbeth bytes, first 90%)")
print(f"vs transformers LlamaForCausalLM + torch fully_shard (Python; {versions})")
print(f"global batch {batch} x {seq_len} tokens split over the ranks, {steps} steps, AdamW lr {lr} "
      f"(warm-up {lr_warmup}, cosine to 0.1x), clip 1.0, seed {seed}; each decoder layer then "
      f"the root sharded (reshard_after_forward); Gloo, CPU, 1 thread per rank on {cores} cores")
print(f"tokens/s: median over steps {int(warmup) + 1}..{steps} (global tokens of a step / its "
      f"wall time); peak RSS: VmHWM per rank at the end, max over ranks (all ranks in brackets)")
if any(r.get("threads", 1) != 1 for r in py_ok):
    print(f"WARNING: torch intra-op threads per rank were "
          f"{sorted({r['threads'] for r in py_ok})}, not 1")
print()
print("| ranks | mdist tokens/s | PyTorch tokens/s | tokens/s C++/Py (paired rounds) "
      "| mdist peak RSS MiB (max rank) | PyTorch peak RSS MiB | RSS C++/Py "
      "| mdist loss first→last | PyTorch loss first→last |")
print("|---:|---:|---:|---:|---:|---:|---:|---|---|")
def ok(r):
    return r is not None and "error" not in r
def spread(values, fmt):
    if not values:
        return "FAILED"
    values = sorted(values)
    median = values[(len(values) - 1) // 2]
    return f"{fmt.format(median)} [{fmt.format(values[0])}, {fmt.format(values[-1])}]"
failures = [f"{r['impl']} on {r['world']} rank(s): {r['error']}" for r in rows if not ok(r)]
for world in sorted({r["world"] for r in rows}):
    cpp = {r["round"]: r for r in rows if r["world"] == world and r["impl"] == CPP and ok(r)}
    py = {r["round"]: r for r in rows if r["world"] == world and r["impl"] == PY and ok(r)}
    pairs = sorted(set(cpp) & set(py))
    cells = [str(world),
             spread([r["tokens_per_s"] for r in cpp.values()], "{:.0f}"),
             spread([r["tokens_per_s"] for r in py.values()], "{:.0f}"),
             spread([cpp[k]["tokens_per_s"] / py[k]["tokens_per_s"] for k in pairs], "{:.2f}"),
             spread([max(r["peak_rss_mib"]) for r in cpp.values()], "{:.0f}"),
             spread([max(r["peak_rss_mib"]) for r in py.values()], "{:.0f}"),
             spread([max(cpp[k]["peak_rss_mib"]) / max(py[k]["peak_rss_mib"]) for k in pairs],
                    "{:.2f}")]
    for side in (cpp, py):
        first = side[min(side)] if side else None
        cells.append(f"{first['first_loss']:.3f} → {first['last_loss']:.3f}" if first else "FAILED")
    print("| " + " | ".join(cells) + " |")
print()
print("each cell: median [min, max] over the rounds; the ratios pair each C++ run with the "
      "Python run right after it")
for failure in failures:
    print(f"FAILED {failure}")
imported = [r["import_rss_mib"] for r in py_ok]
print("peak RSS includes everything each process holds: on the Python side the interpreter, torch "
      "(the PyPI build, CUDA libraries included)\nand transformers"
      + (f", {'-'.join(sorted({f'{x:.0f}' for x in imported}, key=float))} MiB resident right "
         "after the imports (rank 0), before any model or data" if imported else "") + "; "
      + "the initial weights and the batches' order come from each side's own seeded RNG, so "
      "the losses are comparable, not equal")
print(f"load average before {load_before}, after {load_after}; whole run: {elapsed} s")
PY
