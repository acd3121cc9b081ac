#!/usr/bin/env bash
# Peak RSS per rank while loading a Llama-style checkpoint (~156 M parameters, fp32, 8 decoder
# layers, hidden 1024, vocab 32000, untied head) on 1, 2 and 4 ranks: hf::load_pretrained_fsdp2
# (built on the meta device, each rank reading only its rows from the mmap'd safetensors)
# beside a plain full load (hf::load_pretrained on every rank, then fsdp2_wrap), as one table.
#   bench/load_rss.sh
# Environment: BUILD_DIR (default build), RANKS ("1 2 4"), RUN_TIMEOUT (300 s per run, so that
# a hung job becomes a failed row), TMPDIR (where the ~600 MiB checkpoint is written, once).
set -uo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build}"
ranks="${RANKS:-1 2 4}"
run_timeout="${RUN_TIMEOUT:-300}"
began=$SECONDS

cmake --build "$build" --target load_rss mdistrun >/dev/null || { echo "build failed in $build" >&2; exit 1; }
work="$(mktemp -d "${TMPDIR:-/tmp}/mdist-load-rss.XXXXXX")"
trap 'rm -rf "$work"' EXIT
ckpt="$work/checkpoint"
results="$work/results.jsonl"
mkdir -p "$ckpt"
cat >"$ckpt/config.json" <<'JSON'
{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "hidden_size": 1024,
  "intermediate_size": 2816,
  "num_hidden_layers": 8,
  "num_attention_heads": 16,
  "num_key_value_heads": 4,
  "max_position_embeddings": 2048,
  "vocab_size": 32000,
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "float32"
}
JSON
"$build/bin/load_rss" write "$ckpt" || { echo "writing the checkpoint failed" >&2; exit 1; }

# run MODE WORLD: appends the run's JSON line, or one describing its failure.
run() {
  local mode="$1" world="$2" log="$work/$1-$2.log" start=$SECONDS
  timeout --kill-after=30 "$run_timeout" "$build/bin/mdistrun" --nproc-per-node "$world" \
    "$build/bin/load_rss" "$mode" "$ckpt" >"$log" 2>&1
  local rc=$?
  local line
  line="$(sed 's/^\[rank0\]: //' "$log" | grep '^{' | tail -n 1)"
  if [[ $rc -ne 0 || -z "$line" ]]; then
    echo "---- $mode on $world ranks failed (exit $rc); last lines of its output:" >&2
    tail -n 15 "$log" >&2
    echo "{\"mode\": \"$mode\", \"world\": $world, \"error\": \"exit $rc\"}" >>"$results"
  else
    echo "$line" >>"$results"
  fi
  echo "$mode, $world rank(s): $((SECONDS - start)) s" >&2
}

for world in $ranks; do
  run fsdp2 "$world"
  run full "$world"
done

python3 - "$results" "$((SECONDS - began))" <<'PY'
import json, math, sys
path, elapsed = sys.argv[1:]
rows = [json.loads(line) for line in open(path) if line.startswith("{")]
MIB = 1024 * 1024
by = {(r["mode"], r["world"]): r for r in rows}
ok = [r for r in rows if "error" not in r]
if not ok:
    sys.exit("no run succeeded")
r0 = ok[0]
ckpt, layer, params = r0["checkpoint_bytes"] / MIB, r0["layer_bytes"] / MIB, r0["param_bytes"] / MIB
print(f"Loading a Llama-style checkpoint: {params:.0f} MiB of fp32 parameters "
      f"({r0['param_bytes'] // 4 / 1e6:.1f} M; 8 layers of {layer:.1f} MiB, hidden 1024, vocab 32000, "
      f"untied), one {ckpt:.0f} MiB safetensors file")
print("fsdp2 = hf::load_pretrained_fsdp2 (meta build, fsdp2_wrap, each rank reads its rows "
      "from the mmap); full = hf::load_pretrained on every rank, then fsdp2_wrap")
print("peak = VmHWM restarted just before the load, minus the baseline VmRSS at that moment "
      "(libtorch + process group), max over ranks")
print()
print("| ranks | checkpoint MiB | expected total/W + one layer MiB | fsdp2 load peak MiB (max rank) "
      "| ratio to expected | full load peak MiB | ratio fsdp2/full |")
print("|---:|---:|---:|---:|---:|---:|---:|")
notes = []
for world in sorted({r["world"] for r in rows}):
    f, g = by.get(("fsdp2", world)), by.get(("full", world))
    expected = ckpt / world + layer
    def peak(r):
        return None if not r or "error" in r else max(p - b for p, b in zip(r["peak_mib"], r["baseline_mib"]))
    pf, pg = peak(f), peak(g)
    cell = lambda v, fmt="{:.0f}": "FAILED" if v is None else fmt.format(v)
    print(f"| {world} | {ckpt:.0f} | {expected:.0f} | {cell(pf)} | "
          f"{cell(None if pf is None else pf / expected, '{:.2f}')} | {cell(pg)} | "
          f"{cell(None if pf is None or pg is None else pf / pg, '{:.2f}')} |")
    for name, r in (("fsdp2", f), ("full", g)):
        if r and "error" not in r:
            notes.append(f"{name:>5} on {world}: baseline RSS per rank "
                         f"{'/'.join(f'{x:.0f}' for x in r['baseline_mib'])} MiB, load peak "
                         f"{'/'.join(f'{p - b:.0f}' for p, b in zip(r['peak_mib'], r['baseline_mib']))} MiB "
                         f"above it, RSS after {'/'.join(f'{x:.0f}' for x in r['after_mib'])} MiB, "
                         f"load {r['load_s']:.1f} s" + ("" if r["peak_reset"] else
                         " (VmHWM could not be restarted: peak includes startup)"))
print()
print("\n".join(notes))
sums = {(r["mode"], r["world"]): r["checksum"] for r in ok}
ref = next(iter(sums.values()))
same = all(math.isclose(v, ref, rel_tol=1e-9, abs_tol=1e-6) for v in sums.values())
print(f"checksum of the loaded shards: {'identical in every run' if same else 'DIFFERS: ' + str(sums)}")
print(f"whole run: {elapsed} s")
PY
