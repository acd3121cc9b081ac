#!/usr/bin/env bash
# Expert parallelism in `mdist train`: a small Qwen3-MoE (bench/ep_train.py's MODEL: 4 sparse
# layers of 8 experts, top-2, hidden 128, byte vocabulary; written once by transformers with its
# own initialisation) trained on 4 ranks with --ep 1, 2 and 4, beside transformers + PyTorch
# FSDP2 on the same model directory and data (no expert parallelism). The two sides alternate
# (C++ ep 1, Python, C++ ep 2, Python, C++ ep 4, Python, then again, REPEATS times) so that this
# machine's drift hits both alike; each C++ run is paired with the Python run after it.
# Printed as one markdown table: tokens/s median [min, max] of each side, the C++/Python ratio of
# the pairs, peak RSS per rank, and the bytes each rank sent by all-to-all per step (mdist's
# metrics.jsonl) against the analytic count for uniform routing:
#   4 all-to-alls (dispatch and combine, forward and backward) x sparse layers x tokens per rank
#   x top_k x (ep - 1) / ep x hidden x 4 bytes (fp32).
#   bench/ep_train.sh [steps=20]
# Environment: BUILD_DIR (build), WORLD (4), EPS ("1 2 4"), REPEATS (3), WARMUP (3 steps left
# out of the tokens/s median), SEQ_LEN (64), GLOBAL_BATCH (16), RUN_TIMEOUT (600 s per run),
# MDIST_BENCH_VENV / MDIST_CACHE (the bench venv), SKIP_BUILD=1.
set -uo pipefail
cd "$(dirname "$0")/.."
steps="${1:-20}"
build="${BUILD_DIR:-build}"
world="${WORLD:-4}"
eps="${EPS:-1 2 4}"
repeats="${REPEATS:-3}"
warmup="${WARMUP:-3}"
seq_len="${SEQ_LEN:-64}"
batch="${GLOBAL_BATCH:-16}"
run_timeout="${RUN_TIMEOUT:-600}"
cache="${MDIST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mdist}"
venv="${MDIST_BENCH_VENV:-$cache/bench-venv}"
began=$SECONDS
load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
[[ "$steps" =~ ^[0-9]+$ && $steps -gt $warmup ]] ||
  { echo "steps ($steps) must be a number above WARMUP ($warmup)" >&2; exit 1; }

if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  cmake --build "$build" --target mdist_cli mdistrun >/dev/null ||
    { echo "build failed in $build" >&2; exit 1; }
fi
[[ -x "$build/bin/mdist" && -x "$build/bin/mdistrun" ]] ||
  { echo "no $build/bin/mdist or $build/bin/mdistrun (build first: scripts/setup.sh)" >&2; exit 1; }
# shellcheck source=bench/bench_venv.sh
source bench/bench_venv.sh
ensure_bench_venv "torch, numpy, transformers"
[[ $python_ok -eq 1 ]] || { echo "bench: no bench venv (transformers writes the model)" >&2; exit 1; }

export OMP_NUM_THREADS=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
results="$work/results.jsonl"
model="$work/qwen3-moe"
"$venv/bin/python" bench/ep_train.py --make-model "$model" >"$work/make.log" 2>&1 ||
  { cat "$work/make.log" >&2; echo "bench: writing the model failed" >&2; exit 1; }

# run_cpp EP REPEAT: one `mdist train --ep EP` on $world ranks; appends its row.
run_cpp() {
  local ep="$1" rep="$2" log="$work/cpp-$1-$2.log" out="$work/cpp-$1-$2"
  timeout --kill-after=30 "$run_timeout" "$build/bin/mdistrun" --nproc-per-node "$world" \
    "$build/bin/mdist" train --model "$model" --ep "$ep" --steps "$steps" --seq-len "$seq_len" \
    --global-batch "$batch" --lr 1e-3 --warmup 5 --save-every 0 --eval-every 0 --log-every 1 \
    --overwrite --out "$out" >"$log" 2>&1
  local rc=$?
  python3 - "$out/metrics.jsonl" "$ep" "$rep" "$warmup" "$rc" "$log" >>"$results" <<'PY'
import json, statistics, sys
path, ep, rep, warmup, rc, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
row = {"impl": "cpp", "ep": ep, "rep": rep}
try:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    sent = [sum(r["all_to_all_bytes"]) / len(r["all_to_all_bytes"]) for r in rows[warmup:]
            if "all_to_all_bytes" in r]
    row.update(tokens_per_s=statistics.median_low(r["tokens_per_s"] for r in rows[warmup:]),
               peak_rss_mib=rows[-1]["peak_rss_mib"], first_loss=rows[0]["loss"],
               last_loss=rows[-1]["loss"], a2a_bytes=statistics.mean(sent) if sent else 0.0)
    if rc != 0:
        row["error"] = f"exit {rc}"
except Exception as e:  # a failed run is a row, not a crash of the bench
    lines = [l.strip() for l in open(log) if "error" in l] or ["no metrics"]
    row["error"] = f"exit {rc}: {lines[0][:160]} ({e.__class__.__name__})"
print(json.dumps(row))
PY
}

run_py() {
  local rep="$1" log="$work/py-$1.log"
  timeout --kill-after=30 "$run_timeout" "$venv/bin/python" -m torch.distributed.run --standalone \
    --nproc-per-node "$world" bench/ep_train.py --model "$model" --steps "$steps" \
    --warmup-steps "$warmup" --seq-len "$seq_len" --global-batch "$batch" >"$log" 2>&1
  local rc=$?
  local line
  line="$(sed 's/^\[rank0\]: //' "$log" | grep '^{' | tail -n 1)"
  if [[ $rc -ne 0 || -z "$line" ]]; then
    echo "---- Python run $rep failed (exit $rc):" >&2
    tail -n 15 "$log" >&2
    echo '{"impl": "py", "rep": '"$rep"', "error": "exit '"$rc"'"}' >>"$results"
  else
    echo "$line" | python3 -c 'import json,sys; r=json.load(sys.stdin); r["rep"]='"$rep"'; print(json.dumps(r))' >>"$results"
  fi
}

pair=0
for ((rep = 1; rep <= repeats; rep++)); do
  for ep in $eps; do
    pair=$((pair + 1))
    run_cpp "$ep" "$pair"
    run_py "$pair"
    echo "pair $pair (ep $ep) done at $((SECONDS - began)) s" >&2
  done
done

python3 - "$results" "$model/config.json" "$steps" "$warmup" "$batch" "$seq_len" "$world" \
  "$(getconf _NPROCESSORS_ONLN)" "$((SECONDS - began))" "$load_before" \
  "$(cut -d' ' -f1-3 /proc/loadavg)" <<'PY'
import json, statistics, sys
(path, config_path, steps, warmup, batch, seq_len, world, cores, elapsed, load_before,
 load_after) = sys.argv[1:]
rows = [json.loads(line) for line in open(path) if line.startswith("{")]
config = json.load(open(config_path))
steps, batch, seq_len, world = int(steps), int(batch), int(seq_len), int(world)
hidden, k, layers = config["hidden_size"], config["num_experts_per_tok"], config["num_hidden_layers"]
by_rep = {r["rep"]: r for r in rows if r["impl"] == "py"}
py_ok = [r for r in rows if r["impl"] == "py" and "error" not in r]
def spread(values, fmt="{:.0f}"):
    if not values:
        return "n/a"
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"
print(f"`mdist train --ep` on a Qwen3-MoE ({py_ok[0]['params'] if py_ok else '?'} parameters: "
      f"{layers} sparse layers of {config.get('num_experts', config.get('num_local_experts'))} experts, top-{k}, hidden {hidden}, "
      f"vocab {config['vocab_size']}, fp32) on {world} ranks")
print(f"vs transformers Qwen3MoeForCausalLM + torch fully_shard over all ranks (Python, no EP"
      + (f"; torch {py_ok[0]['torch']}, transformers {py_ok[0]['transformers']}, experts "
         f"implementation {py_ok[0].get('experts')}" if py_ok else "")
      + ")")
print(f"global batch {batch} x {seq_len} tokens, {steps} steps (tokens/s: median of steps "
      f"{int(warmup) + 1}..{steps}), AdamW lr 1e-3, clip 1.0, loss + 0.01 x aux; Gloo, CPU, "
      f"1 thread per rank on {cores} cores; runs alternate C++/Python, median [min, max] over "
      f"{len(by_rep)} pairs")
print()
print("| ep | mdist tokens/s | PyTorch tokens/s | C++/Py (pairs) | mdist peak RSS MiB (max rank) "
      "| PyTorch peak RSS MiB | all-to-all bytes/step/rank | analytic (uniform) | measured/analytic |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
failures = [r for r in rows if "error" in r]
for ep in sorted({r["ep"] for r in rows if r["impl"] == "cpp"}):
    cpp = [r for r in rows if r["impl"] == "cpp" and r["ep"] == ep and "error" not in r]
    pys = [by_rep[r["rep"]] for r in cpp if r["rep"] in by_rep and "error" not in by_rep[r["rep"]]]
    ratios = [c["tokens_per_s"] / by_rep[c["rep"]]["tokens_per_s"] for c in cpp
              if c["rep"] in by_rep and "error" not in by_rep[c["rep"]]]
    tokens_per_rank = batch // world * seq_len
    analytic = 4 * layers * tokens_per_rank * k * (ep - 1) / ep * hidden * 4
    sent = [c["a2a_bytes"] for c in cpp]
    cells = [str(ep), spread([c["tokens_per_s"] for c in cpp]), spread([p["tokens_per_s"] for p in pys]),
             spread(ratios, "{:.2f}"),
             spread([max(c["peak_rss_mib"]) for c in cpp]), spread([max(p["peak_rss_mib"]) for p in pys]),
             spread(sent), f"{analytic:.0f}",
             spread([s / analytic for s in sent], "{:.3f}") if analytic else "n/a (no EP)"]
    print("| " + " | ".join(cells) + " |")
print()
for r in failures:
    print(f"FAILED {r['impl']} ep {r.get('ep', '-')} pair {r.get('rep')}: {r['error']}")
print("all-to-all bytes: what each rank sent to the other ranks of its expert-parallel group "
      "(rows of hidden fp32, plus the per-expert counts), mean over ranks and steps; the analytic "
      "count assumes uniform routing, the measured one follows the router's real choices")
print(f"load average before {load_before}, after {load_after}; whole run: {elapsed} s")
PY
