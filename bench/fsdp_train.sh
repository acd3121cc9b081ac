#!/usr/bin/env bash
# FSDP training of a ~27.5 M parameter Llama-shaped stack (8 layers, hidden 512) on 1, 2 and
# 4 ranks: mdist's fully_shard (C++, bench/fsdp_train.cpp through mdistrun) beside PyTorch's
# own fully_shard (Python, bench/fsdp_train.py through torchrun, the same torch version), the
# same model, initial weights, data and steps, as one table with C++/Python ratios and the
# sharding bars. This machine's speed drifts, so each rank count alternates the two sides
# ROUNDS times and the ratios are paired per round: median [min, max] over the rounds.
#   bench/fsdp_train.sh [timed_steps=8]
# Environment: BUILD_DIR (default build), RANKS ("1 2 4"), ROUNDS (3), WARMUP (3), GLOBAL_BATCH (4
# sequences, split over the ranks), SEQ_LEN (128), RUN_TIMEOUT (600 s per run, so that a hung
# job becomes a failed row), MDIST_CACHE (where the bench venv lives), MDIST_BENCH_VENV (a venv of
# one's own with torch instead), FSDP_BENCH_DEVICE (cpu or cuda) and FSDP_BENCH_PARAM_DTYPE (fp32 or
# bf16), read by both sides, and FSDP_BENCH_ADAMW (fused or plain: mdist's side only).
# Needs a build (scripts/setup.sh) and creates a bench-only venv with torch on first use.
set -uo pipefail
cd "$(dirname "$0")/.."
steps="${1:-8}"
build="${BUILD_DIR:-build}"
ranks="${RANKS:-1 2 4}"
rounds="${ROUNDS:-3}"
warmup="${WARMUP:-3}"
batch="${GLOBAL_BATCH:-4}"
seq_len="${SEQ_LEN:-128}"
run_timeout="${RUN_TIMEOUT:-600}"
cache="${MDIST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mdist}"
venv="${MDIST_BENCH_VENV:-$cache/bench-venv}" # MDIST_BENCH_VENV: an existing venv with torch (a GPU machine's)
began=$SECONDS

cmake --build "$build" --target fsdp_train mdistrun >/dev/null || { echo "build failed in $build" >&2; exit 1; }
# shellcheck source=bench/bench_venv.sh
source bench/bench_venv.sh
ensure_bench_venv "torch, numpy"

# One thread per rank on both sides: the ranks share this machine's cores, and torch would
# otherwise start a full thread pool in every rank.
export OMP_NUM_THREADS=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
results="$work/results.jsonl"

# run IMPL WORLD ROUND COMMAND...: appends the run's JSON line (with its round), or one
# describing its failure.
run() {
  local impl="$1" world="$2" round="$3" log="$work/$1-$2-$3.log"
  shift 3
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
    echo "---- $impl on $world ranks failed (exit $rc); last lines of its output:" >&2
    tail -n 15 "$log" >&2
    IMPL="$impl" WORLD="$world" RC="$rc" WHY="$why" python3 -c '
import json, os
print(json.dumps({"impl": os.environ["IMPL"], "world": int(os.environ["WORLD"]),
                  "error": "exit %s: %s" % (os.environ["RC"], os.environ["WHY"][:160])}))' >"$work/line"
    line="$(cat "$work/line")"
  fi
  ROUND="$round" LINE="$line" python3 -c '
import json, os
row = json.loads(os.environ["LINE"])
row["round"] = int(os.environ["ROUND"])
print(json.dumps(row))' >>"$results"
  echo "$impl, $world rank(s), round $round: $((SECONDS - start)) s" >&2
}

for world in $ranks; do
  for ((round = 1; round <= rounds; ++round)); do
    run "mdist (C++)" "$world" "$round" "$build/bin/mdistrun" --nproc-per-node "$world" \
      "$build/bin/fsdp_train" "$steps" "$warmup" "$batch" "$seq_len"
    # The profile's compute part: the same steps without fully_shard, in the same round.
    run "compute only" "$world" "$round" "$build/bin/mdistrun" --nproc-per-node "$world" \
      "$build/bin/fsdp_train" "$steps" "$warmup" "$batch" "$seq_len" compute
    if [[ $python_ok -eq 1 ]]; then
      run "torch FSDP2 (Python)" "$world" "$round" "$venv/bin/python" -m torch.distributed.run \
        --standalone --nproc-per-node "$world" bench/fsdp_train.py "$steps" "$warmup" "$batch" "$seq_len"
    else
      echo '{"impl": "torch FSDP2 (Python)", "world": '"$world"', "round": '"$round"', "error": "no bench venv"}' >>"$results"
    fi
  done
done

python3 - "$results" "$steps" "$warmup" "$batch" "$seq_len" "$(getconf _NPROCESSORS_ONLN)" "$((SECONDS - began))" "$rounds" <<'PY'
import json, math, statistics, sys
path, steps, warmup, batch, seq_len, cores, elapsed, rounds = sys.argv[1:]
rows = [json.loads(line) for line in open(path) if line.startswith("{")]
MIB = 1024 * 1024
CPP, PY = "mdist (C++)", "torch FSDP2 (Python)"
compute = {(r["world"], r["round"]): r["compute_s"] for r in rows
           if r["impl"] == "compute only" and "error" not in r}
rows = [r for r in rows if r["impl"] != "compute only" or "error" in r]
ok = [r for r in rows if "error" not in r]
params = sorted({r["params"] for r in ok})
print(f"FSDP training, Llama-shaped stack: {params[0] if params else '?'} parameters "
      f"(8 layers, hidden 512, 8 heads, SwiGLU 1536, vocab 256), fp32, AdamW lr 1e-3")
print(f"global batch {batch} x {seq_len} tokens split over the ranks; {warmup} warm-up + {steps} "
      f"timed steps, median step (slowest rank); OMP_NUM_THREADS=1 per rank on {cores} cores")
print(f"{rounds} rounds per rank count, C++ then Python in each; the table shows each side's "
      "median-step round, the ratios are per round")
adamws = sorted({r.get("adamw", "torch.optim.AdamW (default: for-loop on CPU)") for r in ok})
print(f"optimizers: {'; '.join(adamws)}")
devices = sorted({f"{r.get('device', 'cpu')} {r.get('param_dtype', 'fp32')} param_dtype" for r in ok})
print("units: each decoder layer, then the root (reshard_after_forward=True); "
      f"on {', '.join(devices) or 'cpu'} (Gloo on CPU, NCCL on CUDA); both sides start from the "
      "same weights and see the same tokens")
if sorted({r["threads"] for r in ok}) not in ([], [1]):
    print(f"WARNING: torch intra-op threads per rank were {sorted({r['threads'] for r in ok})}, not 1")
checksums = [r["init_checksum"] for r in ok]
if len(params) > 1 or (checksums and not all(math.isclose(c, checksums[0], rel_tol=1e-9) for c in checksums)):
    print(f"WARNING: the runs built different models: params {params}, init checksums {checksums}")
print()

def bar(good):
    return "ok" if good else "FAIL"

head = (f"{'ranks':>5} {'impl':<20} {'step s':>7} {'fwd/bwd/opt s':>15} {'tokens/s':>8} "
        f"{'peak RSS MiB':>12} {'RSS per rank':<20} {'persist MiB':>11} {'vs total/W':>12} "
        f"{'full params at once':>24} {'first loss':>10} {'last loss':>10}")
print(head)
print("-" * len(head))
failed_bars = []
# The bars are checked on every C++ run; the table shows the round with the median step.
def check_bars(r):
    expected = r["persistent_expected_bytes"]
    worst = max(abs(p / expected - 1) for p in r["persistent_bytes"])
    persist_ok = worst <= 0.05 + r["padding_allowance_bytes"] / expected
    units_ok = int(r["max_full_layer_units"]) <= 2 and r["backward_probe_samples"] > 0
    return persist_ok, units_ok
for r in ok:
    if r["impl"] == CPP and not all(check_bars(r)) and r["world"] not in failed_bars:
        failed_bars.append(r["world"])
shown = []
for world in sorted({r["world"] for r in rows}):
    for impl in (CPP, PY):
        runs = [r for r in rows if r["world"] == world and r["impl"] == impl]
        shown += [r for r in runs if "error" in r]
        good = sorted((r for r in runs if "error" not in r), key=lambda r: r["step_s"])
        if good:
            shown.append(good[(len(good) - 1) // 2])
for r in shown:
    if "error" in r:
        print(f"{r['world']:>5} {r['impl']:<20} FAILED (round {r['round']}): {r['error']}")
        continue
    rss = r["peak_rss_mib"]
    persist = max(r["persistent_bytes"])
    expected = r["persistent_expected_bytes"]
    persist_ok, units_ok = check_bars(r)
    layers = int(r["max_full_layer_units"])
    root = int(r["max_full_units"]) - layers
    full = f"{'root+' if root else ''}{layers} ({r['max_full_param_mib']:.1f} MiB) {bar(units_ok)}"
    phases = f"{r['forward_s']:.2f}/{r['backward_s']:.2f}/{r['optimizer_s']:.2f}"
    print(f"{r['world']:>5} {r['impl']:<20} {r['step_s']:>7.3f} {phases:>15} {r['tokens_per_s']:>8.1f} "
          f"{max(rss):>12.0f} {'/'.join(f'{x:.0f}' for x in rss):<20} {persist / MIB:>11.1f} "
          f"{persist / expected:>7.3f} {bar(persist_ok):>4} {full:>24} "
          f"{r['first_loss']:>10.5f} {r['last_loss']:>10.5f}")
print()
print("C++ / Python, paired per round: median [min, max]")
cols = [("step", "step_s"), ("forward", "forward_s"), ("backward", "backward_s"),
        ("optimizer", "optimizer_s"), ("peak RSS", "peak_rss_mib")]
print(f"{'ranks':>5} {'rounds':>6} " + " ".join(f"{name:>18}" for name, _ in cols))
for world in sorted({r["world"] for r in rows}):
    pairs = []
    for rnd in sorted({r["round"] for r in rows if r["world"] == world}):
        side = {r["impl"]: r for r in rows if r["world"] == world and r["round"] == rnd}
        if all(impl in side and "error" not in side[impl] for impl in (CPP, PY)):
            pairs.append((side[CPP], side[PY]))
    if not pairs:
        print(f"{world:>5} {0:>6} n/a (no round with both runs ok)")
        continue
    cells = []
    for _, key in cols:
        value = (lambda c, p: max(c[key]) / max(p[key])) if key == "peak_rss_mib" else \
                (lambda c, p: c[key] / p[key])
        ratios = [value(c, p) for c, p in pairs]
        cells.append(f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")
    print(f"{world:>5} {len(pairs):>6} " + " ".join(f"{cell:>18}" for cell in cells))
print()
print("Roofline (mdist, the median-step round): model FLOPs per step = 6 x matmul parameters x tokens + "
      "attention 12 B T^2 d L;\n  peak = the single-thread GEMM rate in the compute dtype (fp32, or bf16 with "
      "FSDP_BENCH_PARAM_DTYPE=bf16) on the model's matmul shapes (rank 0 alone) x min(ranks, cores)")
head = (f"{'ranks':>5} {'GEMM GFLOP/s':>12} {'GFLOP/step':>10} {'achieved GFLOP/s':>16} {'of peak':>7} "
        f"{'gather MiB/rank':>15} {'reduce MiB/rank':>15} {'vs analytic':>11} {'wire MiB/rank':>13} "
        f"{'loopback MB/s':>13} {'wire time s':>11}")
print(head)
print("-" * len(head))
cpp_shown = [r for r in shown if r["impl"] == CPP and "error" not in r]
for r in cpp_shown:
    w = r["world"]
    peak = r["gemm_gflops_1thread"] * min(w, int(r.get("cores", cores)))
    achieved = r["model_gflop_per_step"] / r["step_s"]
    measured = r["gather_bytes_per_rank"] + r["reduce_bytes_per_rank"]
    analytic = r["analytic_gather_bytes"] + r["analytic_reduce_bytes"]
    wire = measured * (w - 1) / w
    bw = r["all_gather_bytes_per_s"]
    print(f"{w:>5} {r['gemm_gflops_1thread']:>12.1f} {r['model_gflop_per_step']:>10.1f} {achieved:>16.1f} "
          f"{achieved / peak:>7.2f} {r['gather_bytes_per_rank'] / MIB:>15.1f} "
          f"{r['reduce_bytes_per_rank'] / MIB:>15.1f} "
          f"{(measured / analytic if analytic else 1.0):>11.3f} {wire / MIB:>13.1f} "
          f"{(bw / 1e6 if bw else float('nan')):>13.0f} {(wire / bw if bw else 0.0):>11.3f}")
print()
print("Where mdist's step goes (the median-step round, slowest rank, seconds and share of the step):")
print("  compute = the same model's forward + backward without fully_shard on the same batch (its own run in "
      "the same round);\n  comm not "
      "hidden = time blocked\n  on all-gathers and reduce-scatters (FsdpHandle::communication()); "
      "optimizer = its step; fully_shard's own work = the rest\n  (packing, copies, hooks, and compute slowed by "
      "Gloo's threads sharing the cores); CPU s = per step and rank, the main thread and all others "
      "(Gloo's)")
head = (f"{'ranks':>5} {'step s':>7} {'compute':>14} {'comm not hidden':>16} {'optimizer':>14} "
        f"{'fully_shard own':>16} {'CPU s main/comm threads':>23} {'adamw':<26}")
print(head)
print("-" * len(head))
for r in cpp_shown:
    step = r["step_s"]
    if (r["world"], r["round"]) not in compute:
        print(f"{r['world']:>5} n/a (the round's compute-only run failed)")
        continue
    parts = [compute[(r["world"], r["round"])], r["comm_wait_s"], r["optimizer_s"]]
    rest = step - sum(parts)
    cells = [f"{v:.3f} ({100 * v / step:.0f}%)" for v in parts + [rest]]
    threads = f"{r['main_thread_cpu_s']:.2f} / {r['other_threads_cpu_s']:.2f}"
    print(f"{r['world']:>5} {step:>7.3f} {cells[0]:>14} {cells[1]:>16} {cells[2]:>14} {cells[3]:>16} "
          f"{threads:>23} {r.get('adamw', '?'):<26}")
print()
print("persist MiB = the largest per-rank sum of shards + gradients + AdamW exp_avg/exp_avg_sq "
      "(from the optimizer state) between steps;\n  vs total/W: against 4 x parameter bytes / W "
      "(what 1 rank holds, split W ways); bar: every rank within 5% (+ padding)")
print("full params at once = most units holding full parameters at the same time (unsharded or "
      "all-gather in flight), sampled at each\n  layer's forward and right after its backward: "
      "root + decoder layers (MiB); bar: at most 2 layers (current + prefetched)")
print("peak RSS = VmHWM of the whole process, max over ranks (includes building the full model "
      "before sharding; on the Python side the interpreter and torch)")
checked = sorted(r["world"] for r in ok if r["impl"] == CPP)
unchecked = sorted(r["world"] for r in rows if r["impl"] == CPP and "error" in r)
verdict = ("not checked" if not checked else "all met" if not failed_bars
           else f"NOT met at {failed_bars} ranks")
print(f"bars for mdist: {verdict}" + (f"; not checked at {unchecked} ranks (run failed)" if unchecked else ""))
print(f"whole run: {elapsed} s")
PY
