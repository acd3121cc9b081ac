# shellcheck shell=bash disable=SC2154  # (the settings come from bench/train_cli.sh)
# Sourced by bench/train_cli.sh when QAT=1 (its settings, venv, `launch` and `fail`): the QAT and
# QAD rows. Per rank count and round, each variant runs on both sides, C++ first:
#   plain    mdist train --model M                          | bench/train_qat.py --quant none
#   fp8/int8 mdist train --model M --quant F               | mtq.quantize(FP8/INT8_DEFAULT_CFG)
#   qad_fp8  mdist train --model M --quant fp8 --teacher M | the same + modelopt's KD loss
# M is one seeded transformers initialisation of data/default written once (bench/train_qat.py
# --write-model), the teacher of the QAD rows too (the unquantized model, as modelopt's QAD);
# both sides read the data in mdist's order, so the first step's losses must agree.
# Step time: the global tokens of a step / its median tokens/s after WARMUP steps, calibration
# excluded (it runs before step 1); the calibration's own time separately (mdist: the time it
# prints on its "quantization-aware training" line; Python: mtq.quantize barrier to barrier).
# Extra settings: VARIANTS ("plain fp8 int8 qad_fp8"; plain is needed for the QAT ÷ plain
# ratio), CALIB_SEQUENCES (64, split over the ranks as mdist splits them).
variants="${VARIANTS:-plain fp8 int8 qad_fp8}"
calib="${CALIB_SEQUENCES:-64}"
[[ "$param_dtype" == fp32 ]] ||
  { echo "QAT=1 runs fp32 only (its bf16 rows are not written yet)" >&2; exit 1; }
[[ $python_ok -eq 1 ]] || { echo "QAT=1 needs the bench venv (it writes the model)" >&2; exit 1; }
model="$work/model"
"$venv/bin/python" bench/train_qat.py --write-model "$model" --seed "$seed" ||
  { echo "bench: could not write the starting model" >&2; exit 1; }

# variant_quant VARIANT: the format a variant quantizes to ("none" for plain).
variant_quant() {
  case "$1" in
    plain) echo none ;;
    qad_*) echo "${1#qad_}" ;;
    *) echo "$1" ;;
  esac
}

run_cpp_qat() {
  local variant="$1" world="$2" round="$3" impl="mdist (C++)"
  local log="$work/cpp-$1-$2-$3.log" out="$work/cpp-$1-$2-$3-out" quant flags=()
  local start=$SECONDS
  quant="$(variant_quant "$variant")"
  [[ "$quant" != none ]] && flags+=(--quant "$quant" --calib-sequences "$calib")
  [[ "$variant" == qad_* ]] && flags+=(--teacher "$model" --distill-temperature 1)
  launch "$log" "$build/bin/mdistrun" --nproc-per-node "$world" "$build/bin/mdist" train \
    --model "$model" --steps "$steps" --seq-len "$seq_len" --global-batch "$batch" --lr "$lr" \
    --warmup "$lr_warmup" --seed "$seed" --save-every 0 --eval-every 0 --overwrite --out "$out" \
    "${flags[@]}"
  local rc=$? line
  if [[ $rc -ne 0 ]]; then
    fail "$impl [$variant]" "$world" "$rc" "$log"
  elif line="$(python3 - "$out/metrics.jsonl" "$log" "$world" "$warmup" "$steps" "$round" \
    "$variant" 2>&1 <<'PY'
import json, re, statistics, sys
path, log, world, warmup, steps, round_, variant = sys.argv[1:]
world, warmup, steps = int(world), int(warmup), int(steps)
rows = [json.loads(line) for line in open(path) if line.strip()]
if len(rows) != steps:
    raise SystemExit(f"bench: metrics.jsonl has {len(rows)} steps, expected {steps}")
calib = re.search(r"calibration on the first (\d+) sequences of .* in ([0-9.]+) s", open(log).read())
if variant != "plain" and not calib:
    raise SystemExit("bench: no calibration time on mdist's quantization-aware training line")
print(json.dumps({"impl": "mdist (C++)", "variant": variant, "world": world,
                  "round": int(round_), "steps": len(rows),
                  "tokens_per_s": statistics.median_low(r["tokens_per_s"] for r in rows[warmup:]),
                  "peak_rss_mib": rows[-1]["peak_rss_mib"],
                  "calib_s": float(calib.group(2)) if calib else None,
                  "calib_sequences": int(calib.group(1)) if calib else 0,
                  "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}))
PY
  )"; then
    echo "$line" >>"$results"
  else
    fail "$impl [$variant]" "$world" "$rc" "$log" "$(echo "$line" | tail -n 1)"
  fi
  echo "$impl $variant, $world rank(s): $((SECONDS - start)) s" >&2
}

run_py_qat() {
  local variant="$1" world="$2" round="$3" impl="modelopt + torch FSDP2 (Python)"
  local log="$work/py-$1-$2-$3.log" flags=()
  local start=$SECONDS
  [[ "$variant" == plain ]] && impl="transformers + torch FSDP2 (Python)"
  [[ "$variant" == qad_* ]] && flags+=(--teacher "$model")
  launch "$log" "$venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node "$world" \
    bench/train_qat.py --model "$model" --quant "$(variant_quant "$variant")" \
    --calib-sequences "$calib" --steps "$steps" --warmup-steps "$warmup" --seq-len "$seq_len" \
    --global-batch "$batch" --lr "$lr" --warmup "$lr_warmup" --seed "$seed" "${flags[@]}"
  local rc=$? line
  line="$(sed 's/^\[rank0\]: //' "$log" | grep '^{' | tail -n 1)"
  if [[ $rc -ne 0 || -z "$line" ]]; then
    fail "$impl [$variant]" "$world" "$rc" "$log"
  else
    echo "$line" | python3 -c 'import json, sys
r = json.load(sys.stdin)
r["round"], r["variant"] = int(sys.argv[1]), sys.argv[2]
print(json.dumps(r))' "$round" "$variant" >>"$results"
  fi
  echo "$impl $variant, $world rank(s): $((SECONDS - start)) s" >&2
}

for world in $ranks; do
  for ((round = 1; round <= rounds; ++round)); do
    for variant in $variants; do
      run_cpp_qat "$variant" "$world" "$round"
      run_py_qat "$variant" "$world" "$round"
    done
  done
done

python3 - "$results" "$steps" "$warmup" "$batch" "$seq_len" "$lr" "$lr_warmup" "$seed" \
  "$(getconf _NPROCESSORS_ONLN)" "$((SECONDS - began))" "$load_before" \
  "$(cut -d' ' -f1-3 /proc/loadavg)" "$calib" "$variants" <<'PY'
import json, sys
(path, steps, warmup, batch, seq_len, lr, lr_warmup, seed, cores, elapsed, load_before,
 load_after, calib, variants) = sys.argv[1:]
rows = [json.loads(line) for line in open(path) if line.startswith("{")]
CPP = "mdist (C++)"
tokens = int(batch) * int(seq_len)
ok = [r for r in rows if "error" not in r]
py_ok = [r for r in ok if r["impl"] != CPP]
versions = (f"torch {py_ok[0]['torch']}, transformers {py_ok[0]['transformers']}, "
            f"modelopt {py_ok[0]['modelopt']}" if py_ok else "")
print(f"`mdist train --model M` (M: data/default's Llama, 4 layers, hidden 128, vocab 256, one "
      f"seeded transformers initialisation, fp32) with `--quant fp8|int8` (QAT) and "
      f"`--quant fp8 --teacher M` (QAD)")
print(f"vs the same model in transformers + torch fully_shard with modelopt's mtq.quantize "
      f"(FP8_DEFAULT_CFG / INT8_DEFAULT_CFG) and LogitsDistillationLoss (T=1, KD only) "
      f"(Python; {versions})")
print(f"Macbeth bytes (first 90%) in mdist's order on both sides; calibration on the first "
      f"{calib} windows, one per forward, split over the ranks, amax MAX-synced; global batch "
      f"{batch} x {seq_len} tokens, {steps} steps, AdamW lr {lr} (warm-up {lr_warmup}, cosine "
      f"to 0.1x), clip 1.0, seed {seed}; Gloo, CPU, 1 thread per rank on {cores} cores")
print(f"step time: global tokens of a step / its median tokens/s over steps "
      f"{int(warmup) + 1}..{steps}, calibration excluded; calibration: its own wall time")
if any(r.get("threads", 1) != 1 for r in py_ok):
    print("WARNING: torch intra-op threads per rank were not 1")
print()
print("| ranks | run | mdist step ms | Python step ms | step mdist/Py (paired) "
      "| mdist step ÷ mdist plain (paired) | calibration s mdist | calibration s Py "
      "| loss step 1 mdist / Py | loss last step mdist / Py | peak RSS MiB mdist / Py |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|")

def spread(values, fmt):
    if not values:
        return "FAILED" if values is not None else "-"
    values = sorted(values)
    return (f"{fmt.format(values[(len(values) - 1) // 2])} "
            f"[{fmt.format(values[0])}, {fmt.format(values[-1])}]")

def step_ms(r):
    return tokens / r["tokens_per_s"] * 1000.0

NAMES = {"plain": "plain (Python: no modelopt)", "fp8": "QAT fp8", "int8": "QAT int8",
         "qad_fp8": "QAD fp8"}
goals = []
for world in sorted({r["world"] for r in rows}):
    side = lambda impl, v: {r["round"]: r for r in ok if r["world"] == world
                            and r["variant"] == v and (r["impl"] == CPP) == (impl == CPP)}
    plain = side(CPP, "plain")
    for v in variants.split():
        cpp, py = side(CPP, v), side("py", v)
        pairs = sorted(set(cpp) & set(py))
        vs_py = [step_ms(cpp[k]) / step_ms(py[k]) for k in pairs]
        vs_plain = ([step_ms(cpp[k]) / step_ms(plain[k]) for k in sorted(set(cpp) & set(plain))]
                    if v != "plain" else None)
        first = lambda d: d[min(d)] if d else None
        c, p = first(cpp), first(py)
        pair = lambda key, fmt: (f"{fmt.format(c[key]) if c else 'FAILED'} / "
                                 f"{fmt.format(p[key]) if p else 'FAILED'}")
        cells = [str(world), NAMES.get(v, v),
                 spread([step_ms(r) for r in cpp.values()], "{:.1f}"),
                 spread([step_ms(r) for r in py.values()], "{:.1f}"),
                 spread(vs_py, "{:.2f}"), spread(vs_plain, "{:.2f}"),
                 spread([r["calib_s"] for r in cpp.values()] if v != "plain" else None, "{:.2f}"),
                 spread([r["calib_s"] for r in py.values()] if v != "plain" else None, "{:.2f}"),
                 pair("first_loss", "{:.6g}"), pair("last_loss", "{:.6g}"),
                 (f"{max(c['peak_rss_mib']):.0f} / " if c else "FAILED / ")
                 + (f"{max(p['peak_rss_mib']):.0f}" if p else "FAILED")]
        print("| " + " | ".join(cells) + " |")
        if c and p:
            mismatch = [f"{r['impl']} round {r['round']}: {r['calib_sequences']}"
                        for r in list(cpp.values()) + list(py.values())
                        if v != "plain" and r["calib_sequences"] != c["calib_sequences"]]
            if mismatch:
                print(f"WARNING: calibration sequence counts differ: {mismatch}")
            rel = abs(c["first_loss"] - p["first_loss"]) / max(abs(p["first_loss"]), 1e-30)
            goals.append(f"{world} rank(s) {v}: first-step loss relative gap {rel:.1e}")
        if v != "plain" and vs_py:
            med = sorted(vs_py)[(len(vs_py) - 1) // 2]
            goals.append(f"{world} rank(s) {v}: mdist/Python step {med:.2f} "
                         f"({'meets' if med <= 0.85 else 'misses'} the goal <= 0.85)")
        if vs_plain:
            med = sorted(vs_plain)[(len(vs_plain) - 1) // 2]
            # The 1.3 goal is QAT's: a QAD step runs the teacher's forward besides.
            verdict = ("a teacher forward more than QAT; the <= 1.3 goal is QAT's"
                       if v.startswith("qad_") else
                       f"{'meets' if med <= 1.3 else 'misses'} the goal <= 1.3")
            goals.append(f"{world} rank(s) {v}: mdist step / mdist plain {med:.2f} ({verdict})")
print()
print("each cell: median [min, max] over the rounds; the paired ratios divide runs of the same "
      "round (mdist/Py: the Python run right after the mdist one; ÷ plain: that round's mdist "
      "plain run); losses and RSS of round 1. The plain row's Python side is the same loop "
      "without modelopt (transformers + FSDP2)")
for line in goals:
    print(line)
for r in rows:
    if "error" in r:
        print(f"FAILED {r['impl']} on {r['world']} rank(s): {r['error']}")
print(f"load average before {load_before}, after {load_after}; whole run: {elapsed} s")
PY
