#!/usr/bin/env bash
# `mdist tokenize` on 1 and 2 ranks beside Hugging Face `tokenizers` (Python, bench/tokenize_hf.py:
# encode_batch with add_special_tokens, EOS appended, uint32 written) on the same tokenizer.json
# and corpus, alternating C++ and Python runs for PAIRS pairs, as median/min/max wall seconds and
# ratios; the outputs are compared byte for byte. Then the peak RSS of tokenizing a large
# generated corpus beside a small one, and of training (`mdist train --steps 2`) on a large
# generated (sparse) .u16 file beside a small one.
#   bench/tokenize.sh [corpus MiB = 32]
# Environment: BUILD_DIR (default build), FAMILY (a fixture of tests/hf/tokenizer/fixtures:
# llama2, gpt2, llama3, qwen2, mistral; default llama2), RANKS ("1 2"), PAIRS (3), BIG_MIB (256:
# the large corpus of the RSS table), BIG_U16_GIB (2: the large token file), MDIST_CACHE (where
# the bench venv lives), SKIP_BUILD=1, TMPDIR (where the files are generated).
set -uo pipefail
cd "$(dirname "$0")/.."
mib="${1:-32}"
build="${BUILD_DIR:-build}"
family="${FAMILY:-llama2}"
ranks="${RANKS:-1 2}"
pairs="${PAIRS:-3}"
big_mib="${BIG_MIB:-256}"
big_gib="${BIG_U16_GIB:-2}"
cache="${MDIST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mdist}"
venv="$cache/bench-venv"
fixture="tests/hf/tokenizer/fixtures/$family"
began=$SECONDS
[[ -f "$fixture/tokenizer.json" ]] || { echo "no tokenizer fixture $fixture" >&2; exit 1; }
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  cmake --build "$build" --target mdist_cli mdistrun >/dev/null ||
    { echo "build failed in $build" >&2; exit 1; }
fi
# shellcheck source=bench/bench_venv.sh
source bench/bench_venv.sh
ensure_bench_venv "tokenizers"
export OMP_NUM_THREADS=1
work="$(mktemp -d "${TMPDIR:-/tmp}/mdist-tokenize-bench.XXXXXX")"
trap 'rm -rf "$work"' EXIT
results="$work/results.jsonl"
model="$work/model"
mkdir -p "$model"
cp "$fixture/tokenizer.json" "$fixture/tokenizer_config.json" "$model/"

# corpus FILE MIB: the fixture corpus repeated (each copy numbered, so lines differ) to MIB MiB.
corpus() {
  python3 - "$1" "$2" tests/hf/tokenizer/fixtures/corpus.txt <<'PY'
import sys
path, mib, source = sys.argv[1], float(sys.argv[2]), open(sys.argv[3], "rb").read()
target = int(mib * (1 << 20))
with open(path, "wb") as out:
    written = copy = 0
    while written < target:
        chunk = source + b"copy %d\n" % copy
        out.write(chunk)
        written += len(chunk)
        copy += 1
PY
}

# measure NAME WORLD COMMAND...: runs COMMAND, appends {"impl", "world", "seconds",
# "peak_rss_mib" (largest single process, ranks included)} to the results, or an error.
measure() {
  local impl="$1" world="$2"
  shift 2
  python3 - "$impl" "$world" "$work/last.log" "$@" >>"$results" <<'PY'
import json, resource, subprocess, sys, time
impl, world, log, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
began = time.perf_counter()
with open(log, "w") as out:
    rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode
seconds = time.perf_counter() - began
row = {"impl": impl, "world": world, "seconds": seconds,
       "peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}
if rc != 0:
    row["error"] = f"exit {rc}: " + open(log).read().strip().splitlines()[-1][:200]
print(json.dumps(row))
PY
  grep -q '"error"' <(tail -n 1 "$results") && { echo "---- $impl failed:" >&2; tail -n 5 "$work/last.log" >&2; }
}

corpus "$work/corpus.txt" "$mib"
for pair in $(seq 1 "$pairs"); do
  for world in $ranks; do
    measure "mdist tokenize" "$world" "$build/bin/mdistrun" --nproc-per-node "$world" \
      "$build/bin/mdist" tokenize --model "$model" --data "$work/corpus.txt" \
      --out "$work/cpp-$world.u32"
  done
  if [[ $python_ok -eq 1 ]]; then
    measure "tokenizers (Python)" 0 "$venv/bin/python" bench/tokenize_hf.py --model "$model" \
      --data "$work/corpus.txt" --out "$work/py.u32"
  fi
  echo "pair $pair done ($((SECONDS - began)) s)" >&2
done
identical=""
for world in $ranks; do
  if [[ -f "$work/py.u32" && -f "$work/cpp-$world.u32" ]]; then
    cmp -s "$work/py.u32" "$work/cpp-$world.u32" && identical+=" $world:yes" || identical+=" $world:NO"
  fi
done

# Peak RSS against the size of the data.
corpus "$work/small.txt" 0.004
corpus "$work/big.txt" "$big_mib"
for size in small big; do
  measure "rss tokenize $size" 2 "$build/bin/mdistrun" --nproc-per-node 2 "$build/bin/mdist" \
    tokenize --model "$model" --data "$work/$size.txt" --out "$work/$size.u32"
done
rm -f "$work/big.txt" "$work/big.u32"
truncate -s 1M "$work/small.u16"
truncate -s "${big_gib}G" "$work/big.u16"
for size in small big; do
  measure "rss train $size" 2 "$build/bin/mdistrun" --nproc-per-node 2 "$build/bin/mdist" train \
    --data "$work/$size.u16" --steps 2 --seq-len 128 --global-batch 4 --warmup 1 \
    --eval-every 0 --out "$work/run-$size"
done

python3 - "$results" "$mib" "$family" "$pairs" "$big_mib" "$big_gib" "$identical" \
  "$(getconf _NPROCESSORS_ONLN)" "$((SECONDS - began))" "$(cut -d' ' -f1-3 /proc/loadavg)" <<'PY'
import json, statistics, sys
path, mib, family, pairs, big_mib, big_gib, identical, cores, elapsed, load = sys.argv[1:]
rows = [json.loads(line) for line in open(path) if line.startswith("{")]
failed = [r for r in rows if "error" in r]
ok = [r for r in rows if "error" not in r]
print(f"`mdist tokenize` vs Hugging Face tokenizers (Python, encode_batch, default threads) on a "
      f"{mib} MiB corpus (tests/hf/tokenizer/fixtures/corpus.txt repeated, one document a line), "
      f"tokenizer fixture '{family}'; wall seconds of the whole command (start-up and loading "
      f"included), {pairs} alternating pairs, {cores} cores")
print()
print("| implementation | ranks | median s | min s | max s | MB/s (median) | time vs Python |")
print("|---|---:|---:|---:|---:|---:|---:|")
py = [r["seconds"] for r in ok if r["impl"] == "tokenizers (Python)"]
groups = {}
for r in ok:
    if not r["impl"].startswith("rss"):
        groups.setdefault((r["impl"], r["world"]), []).append(r["seconds"])
for (impl, world), times in sorted(groups.items(), key=lambda kv: (kv[0][0] != "mdist tokenize", kv[0][1])):
    median = statistics.median(times)
    ratio = f"{median / statistics.median(py):.2f}" if py else "n/a"
    print(f"| {impl} | {world or 'threads'} | {median:.2f} | {min(times):.2f} | {max(times):.2f} | "
          f"{float(mib) * 1.048576 / median:.1f} | {ratio} |")
print()
print(f"outputs identical to Python's (ranks:yes/NO):{identical or ' not compared'}")
print()
print("| peak RSS (largest process), 2 ranks | small | large | large - small |")
print("|---|---:|---:|---:|")
by = {r["impl"]: r for r in ok}
for what, small, big in (("tokenize", "4 KiB text", f"{big_mib} MiB text"),
                         ("train --steps 2", "1 MiB .u16", f"{big_gib} GiB .u16 (sparse)")):
    key = what.split()[0]
    s, b = by.get(f"rss {key} small"), by.get(f"rss {key} big")
    if s and b:
        print(f"| {what}: {small} vs {big} | {s['peak_rss_mib']:.0f} MiB | "
              f"{b['peak_rss_mib']:.0f} MiB | {b['peak_rss_mib'] - s['peak_rss_mib']:+.0f} MiB |")
    else:
        print(f"| {what} | FAILED | FAILED | |")
for r in failed:
    print(f"FAILED {r['impl']} ({r['world']} ranks): {r['error']}")
print(f"load average after {load}; whole run: {elapsed} s")
PY
