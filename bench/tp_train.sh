#!/usr/bin/env bash
# Tensor parallelism + FSDP2 training of the ~27.5 M parameter Llama-shaped stack (8 layers,
# hidden 512, 8 heads, SwiGLU 1536, vocab 256) on 4 ranks laid out as (dp, tp) = (4, 1), (2, 2)
# and (1, 4): mdist's hf::parallelize + fsdp2_wrap on hf::CausalLM (C++, bench/tp_train.cpp
# through mdistrun) beside PyTorch's own TP (torch.distributed.tensor.parallel) + fully_shard
# on a 2-D DeviceMesh (Python, bench/tp_train.py through torchrun, the same torch version),
# the same shapes, initial weights, data and steps, as one markdown table with C++/Python
# ratios and mdist's measured tensor-parallel all-reduce traffic against the analytic count.
# This machine's speed drifts, so each layout alternates the two sides ROUNDS times and the
# ratios are paired per round: median [min, max] over the rounds.
#   bench/tp_train.sh [timed_steps=8]
# Environment: BUILD_DIR (default build), LAYOUTS ("4,1 2,2 1,4": dp,tp pairs), ROUNDS (3),
# WARMUP (3), GLOBAL_BATCH (4 sequences, split over the dp ranks), SEQ_LEN (128), RUN_TIMEOUT
# (600 s per run, so that a hung job becomes a failed row), MDIST_CACHE (where the bench venv
# lives). Smoke: ROUNDS=1 bench/tp_train.sh 2
# Needs a build (scripts/setup.sh) and creates a bench-only venv with torch on first use.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
steps="${1:-8}"
build="${BUILD_DIR:-build}"
layouts="${LAYOUTS:-4,1 2,2 1,4}"
rounds="${ROUNDS:-3}"
warmup="${WARMUP:-3}"
batch="${GLOBAL_BATCH:-4}"
seq_len="${SEQ_LEN:-128}"
run_timeout="${RUN_TIMEOUT:-600}"
cache="${MDIST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mdist}"
venv="${MDIST_BENCH_VENV:-$cache/bench-venv}" # MDIST_BENCH_VENV: an existing venv with torch (a GPU machine's)
began=$SECONDS

cmake --build "$build" --target tp_train mdistrun >/dev/null || { echo "build failed in $build" >&2; exit 1; }
# shellcheck source=bench/bench_venv.sh
source bench/bench_venv.sh
ensure_bench_venv "torch, numpy"

# One thread per rank on both sides: the ranks share this machine's cores, and torch would
# otherwise start a full thread pool in every rank.
export OMP_NUM_THREADS=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
results="$work/results.jsonl"

# run IMPL DP TP ROUND COMMAND...: appends the run's JSON line (with its round), or one
# describing its failure.
run() {
  local impl="$1" dp="$2" tp="$3" round="$4" log="$work/${1%% *}-$2x$3-$4.log"
  shift 4
  local start=$SECONDS
  # Both launchers pass SIGTERM on to their ranks.
  timeout --kill-after=30 "$run_timeout" "$@" >"$log" 2>&1
  local rc=$?
  [[ $rc -eq 124 ]] && echo "bench: timed out after $run_timeout s" >>"$log"
  local line
  line="$(sed 's/^\[rank0\]: //' "$log" | grep '^{' | tail -n 1)"
  if [[ $rc -ne 0 || -z "$line" ]]; then
    local why
    # The first line that names the cause: our own "bench:" errors, an exception's message,
    # not the launchers' summaries of which rank failed.
    why="$(grep -E 'bench:|[A-Za-z]+(Error|Exception)\b:' "$log" | grep -vE 'ChildFailedError|elastic' |
      head -n 1 | sed 's/^\[rank[0-9]*\]: //')"
    [[ -z "$why" ]] && why="$(tail -n 1 "$log")"
    echo "---- $impl at (dp, tp) = ($dp, $tp) failed (exit $rc); last lines of its output:" >&2
    tail -n 15 "$log" >&2
    IMPL="$impl" DP="$dp" TP="$tp" RC="$rc" WHY="$why" python3 -c '
import json, os
print(json.dumps({"impl": os.environ["IMPL"], "dp": int(os.environ["DP"]), "tp": int(os.environ["TP"]),
                  "error": "exit %s: %s" % (os.environ["RC"], os.environ["WHY"][:160])}))' >"$work/line"
    line="$(cat "$work/line")"
  fi
  ROUND="$round" LINE="$line" python3 -c '
import json, os
row = json.loads(os.environ["LINE"])
row["round"] = int(os.environ["ROUND"])
print(json.dumps(row))' >>"$results"
  echo "$impl, (dp, tp) = ($dp, $tp), round $round: $((SECONDS - start)) s" >&2
}

for layout in $layouts; do
  dp="${layout%,*}" tp="${layout#*,}"
  world=$((dp * tp))
  for ((round = 1; round <= rounds; ++round)); do
    run "mdist (C++)" "$dp" "$tp" "$round" "$build/bin/mdistrun" --nproc-per-node "$world" \
      "$build/bin/tp_train" "$tp" "$steps" "$warmup" "$batch" "$seq_len"
    if [[ $python_ok -eq 1 ]]; then
      run "torch TP+FSDP2 (Python)" "$dp" "$tp" "$round" "$venv/bin/python" -m torch.distributed.run \
        --standalone --nproc-per-node "$world" bench/tp_train.py "$tp" "$steps" "$warmup" "$batch" "$seq_len"
    else
      echo '{"impl": "torch TP+FSDP2 (Python)", "dp": '"$dp"', "tp": '"$tp"', "round": '"$round"', "error": "no bench venv"}' >>"$results"
    fi
  done
done

python3 - "$results" "$steps" "$warmup" "$batch" "$seq_len" "$(getconf _NPROCESSORS_ONLN)" "$((SECONDS - began))" "$rounds" "$layouts" <<'PY'
import json, math, statistics, sys
path, steps, warmup, batch, seq_len, cores, elapsed, rounds, layouts = sys.argv[1:]
rows = [json.loads(line) for line in open(path) if line.startswith("{")]
MIB = 1024 * 1024
CPP, PY = "mdist (C++)", "torch TP+FSDP2 (Python)"
ok = [r for r in rows if "error" not in r]
params = sorted({r["params"] for r in ok})
print(f"TP + FSDP2 training, Llama-shaped stack: {params[0] if params else '?'} parameters "
      f"(8 layers, hidden 512, 8 heads, SwiGLU 1536, vocab 256, untied head), fp32, AdamW lr 1e-3")
print(f"global batch {batch} x {seq_len} tokens split over the dp ranks (the same tokens on the "
      f"tp ranks of a dp group); {warmup} warm-up + {steps} timed steps, median step (slowest rank); "
      f"OMP_NUM_THREADS=1 per rank on {cores} cores")
print(f"{rounds} round(s) per layout, C++ then Python in each; step and RSS columns: median over "
      "the rounds; ratios: paired per round, median [min, max]")
print("C++: hf::parallelize (Megatron: column q/k/v/gate/up, row o/down, vocab-parallel "
      "embedding and head + vocab-parallel cross entropy) then fsdp2_wrap over the dp group; "
      "Python: the same plan with torch.distributed.tensor.parallel + loss_parallel, "
      "fully_shard over mesh['dp']; tp = 1: no TP on either side; Gloo on loopback, CPU")
if sorted({r["threads"] for r in ok}) not in ([], [1]):
    print(f"WARNING: torch intra-op threads per rank were {sorted({r['threads'] for r in ok})}, not 1")
checksums = [r["init_checksum"] for r in ok]
if len(params) > 1 or (checksums and not all(math.isclose(c, checksums[0], rel_tol=1e-9) for c in checksums)):
    print(f"WARNING: the runs built different models: params {params}, init checksums {checksums}")
print()

def med(values):
    return statistics.median(values) if values else float("nan")

def span(values):
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]" if values else "n/a"

print("| (dp, tp) | C++ step ms | Python step ms | C++/Python step | C++ fwd/bwd/opt ms "
      "| Python fwd/bwd/opt ms | peak RSS/rank C++ MiB | Python MiB | C++/Python RSS "
      "| TP all-reduce MiB/step C++ measured | analytic | last loss C++ | Python |")
print("|" + "---|" * 13)
failures, mismatches = [], []
order = []
for layout in layouts.split():
    dp, tp = (int(x) for x in layout.split(","))
    order.append((dp, tp))
for dp, tp in order:
    runs = {impl: [r for r in rows if r["dp"] == dp and r["tp"] == tp and r["impl"] == impl]
            for impl in (CPP, PY)}
    good = {impl: [r for r in runs[impl] if "error" not in r] for impl in (CPP, PY)}
    for impl in (CPP, PY):
        failures += [(dp, tp, r) for r in runs[impl] if "error" in r]
    pairs = []
    for rnd in sorted({r["round"] for r in good[CPP]} & {r["round"] for r in good[PY]}):
        c = next(r for r in good[CPP] if r["round"] == rnd)
        p = next(r for r in good[PY] if r["round"] == rnd)
        pairs.append((c, p))

    def step_ms(impl):
        return f"{1000 * med([r['step_s'] for r in good[impl]]):.0f}" if good[impl] else "FAILED"

    def phases(impl):
        if not good[impl]:
            return "FAILED"
        return "/".join(f"{1000 * med([r[k] for r in good[impl]]):.0f}"
                        for k in ("forward_s", "backward_s", "optimizer_s"))

    def rss(impl):
        return f"{med([max(r['peak_rss_mib']) for r in good[impl]]):.0f}" if good[impl] else "FAILED"

    step_ratio = span([c["step_s"] / p["step_s"] for c, p in pairs])
    rss_ratio = span([max(c["peak_rss_mib"]) / max(p["peak_rss_mib"]) for c, p in pairs])
    if good[CPP]:
        measured = [b for r in good[CPP] for b in r["tp_all_reduce_bytes_per_step"]]
        analytic = good[CPP][0]["tp_all_reduce_analytic_bytes"]
        gathered = [b for r in good[CPP] for b in r["tp_all_gather_bytes_per_step"]]
        if any(b != analytic for b in measured) or any(gathered):
            mismatches.append((dp, tp, sorted(set(measured)), analytic, sorted(set(gathered))))
        lo, hi = min(measured), max(measured)
        meas = f"{lo / MIB:.2f}" if lo == hi else f"{lo / MIB:.2f}-{hi / MIB:.2f}"
        ana = f"{analytic / MIB:.2f}"
    else:
        meas = ana = "n/a"
    loss = {impl: (f"{med([r['last_loss'] for r in good[impl]]):.5f}" if good[impl] else "n/a")
            for impl in (CPP, PY)}
    print(f"| ({dp}, {tp}) | {step_ms(CPP)} | {step_ms(PY)} | {step_ratio} | {phases(CPP)} "
          f"| {phases(PY)} | {rss(CPP)} | {rss(PY)} | {rss_ratio} | {meas} | {ana} "
          f"| {loss[CPP]} | {loss[PY]} |")
print()
for dp, tp, r in failures:
    print(f"FAILED: {r['impl']} at (dp, tp) = ({dp}, {tp}), round {r['round']}: {r['error']}")
print("step = zero_grad + forward (with the loss) + backward + AdamW step; peak RSS = VmHWM of "
      "the whole process, max over ranks\n  (includes building the full model before "
      "splitting and sharding; on the Python side the interpreter and torch)")
print("TP all-reduce = bytes each rank sent into mdist::tp's all-reduces per timed step "
      "(the plan's counters, TensorParallelPlan::communication); analytic:\n  (4 layers + 2) x B_local x T x hidden x 4 "
      "B + the vocab-parallel cross entropy's 3 x B_local x (T - 1) x 4 B; 0 at tp = 1")
if mismatches:
    for dp, tp, measured, analytic, gathered in mismatches:
        print(f"TP traffic MISMATCH at (dp, tp) = ({dp}, {tp}): all-reduce bytes/step {measured} "
              f"vs analytic {analytic:.0f}; all-gather bytes/step {gathered}")
elif any(r["impl"] == CPP for r in ok):
    print("TP traffic: every C++ rank's measured all-reduce bytes equal the analytic count "
          "(and no all-gather)")
print(f"whole run: {elapsed} s")
PY
