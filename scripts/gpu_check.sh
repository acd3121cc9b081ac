#!/usr/bin/env bash
# The GPU check: on a machine with one NVIDIA GPU, builds mdist's CUDA variant (NCCL backend),
# runs what needs a device, and times bench/fsdp_train.sh's model on the GPU beside PyTorch
# FSDP2 on the same GPU. Prints one summary table at the end; the whole log goes to
# $OUT/gpu_check.log when OUT is set (the device tool's output folder), else gpu_check.log.
#
#   scripts/gpu_deps.sh          # here, once: Debian headers for a machine without a registry
#   scripts/gpu_check.sh         # on the GPU machine, with .gpu_deps carried along
#
# libtorch: the GPU machine's own torch (python3 -c 'import torch'), because the pinned wheel's
# CUDA libraries cannot be fetched there; MDIST_LIBTORCH overrides. Its version is printed: a
# version other than the pinned one (2.15.0) is a compatibility run, said so in the table.
# Budget: about 8 minutes on 16 cores (build ~4, tests ~1, bench ~3).
set -uo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-.}"
log="$out/gpu_check.log"
: >"$log"
exec > >(tee -a "$log") 2>&1
began=$SECONDS
declare -a rows=()
row() { rows+=("$(printf '%-44s %s' "$1" "$2")"); }
stage() { echo "==== $* ($((SECONDS - began)) s)"; }

stage "machine"
nvidia-smi -L || { echo "gpu_check: nvidia-smi failed: no NVIDIA GPU here"; exit 1; }
python="${PYTHON:-python3}"
torch_root="${MDIST_LIBTORCH:-$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')}"
torch_version="$("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo unknown)"
echo "libtorch: $torch_root (torch $torch_version); pinned: 2.15.0"
row "torch (libtorch of this machine)" "$torch_version"
venv="$("$python" -c 'import sys; print(sys.prefix)')"

deps="$PWD/.gpu_deps/root"
cmake_deps=()
if [[ -d "$deps" ]]; then
  cmake_deps=(-DCMAKE_PREFIX_PATH="$deps/usr;$deps/usr/lib/x86_64-linux-gnu/cmake;$deps/usr/share/cmake"
    -DMDIST_GLOO_INCLUDE_DIR="$deps/usr/include")
  export PKG_CONFIG_SYSROOT_DIR="$deps" PKG_CONFIG_LIBDIR="$deps/usr/lib/x86_64-linux-gnu/pkgconfig"
  # CMake finds PCRE2 and utf8proc through pkg-config; the carried pkgconf where none is installed.
  if ! command -v pkg-config >/dev/null && [[ -x "$deps/usr/bin/pkgconf" ]]; then
    cmake_deps+=(-DPKG_CONFIG_EXECUTABLE="$deps/usr/bin/pkgconf")
  fi
  export CPATH="$deps/usr/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  echo "gpu_check: no .gpu_deps (scripts/gpu_deps.sh): using the system's headers"
fi

stage "configure and build (CUDA variant, build-gpu/)"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if ! cmake -S . -B build-gpu "${generator[@]}" -DMDIST_LIBTORCH="$torch_root" -DMDIST_WITH_CUDA=ON \
  -DCUDAToolkit_ROOT="${CUDAToolkit_ROOT:-/usr/local/cuda}" "${cmake_deps[@]}" >build-gpu.configure.log 2>&1; then
  tail -n 30 build-gpu.configure.log
  row "configure" "FAILED (see log)"
  printf '%s\n' "${rows[@]}"
  exit 1
fi
if ! cmake --build build-gpu -j "$(nproc)" --target mdist mdistrun mdist_cli gpu_test device_policy_test \
  fsdp_train 2>&1 | tail -n 40; then
  row "build" "FAILED (see log)"
fi
[[ -x build-gpu/bin/gpu_test ]] && row "build" "ok ($((SECONDS - began)) s so far)"

stage "tests on the GPU"
run_test() { # NAME COMMAND...
  local name="$1"
  shift
  if timeout 300 "$@" >"$out/$name.log" 2>&1; then
    row "$name" "passed ($(grep -c '^\[       OK \]' "$out/$name.log") ok, $(grep -c '^\[  SKIPPED \]' "$out/$name.log") skipped)"
  else
    row "$name" "FAILED (exit $?)"
  fi
  grep -E '^\[ +(OK|FAILED|SKIPPED) +\]|Failure|error' "$out/$name.log" | head -n 30
}
if [[ -x build-gpu/bin/gpu_test ]]; then
  run_test device_policy_test build-gpu/bin/device_policy_test
  run_test gpu_test build-gpu/bin/mdistrun --nproc-per-node 1 build-gpu/bin/gpu_test
fi

stage "bench/fsdp_train.sh on the GPU (1 rank), fp32 and bf16 param_dtype"
if [[ -x build-gpu/bin/fsdp_train ]]; then
  for dtype in fp32 bf16; do
    BUILD_DIR=build-gpu RANKS=1 ROUNDS="${ROUNDS:-3}" RUN_TIMEOUT=120 FSDP_BENCH_DEVICE=cuda \
      FSDP_BENCH_PARAM_DTYPE=$dtype MDIST_BENCH_VENV="$venv" GLOBAL_BATCH="${GLOBAL_BATCH:-8}" \
      SEQ_LEN="${SEQ_LEN:-512}" bench/fsdp_train.sh "${STEPS:-20}" >"$out/fsdp_train_$dtype.log" 2>&1
    cat "$out/fsdp_train_$dtype.log"
    ratio="$(grep -m1 -E '^ +1 +[0-9]+ [0-9.]+ \[' "$out/fsdp_train_$dtype.log" || true)"
    row "fsdp_train cuda $dtype (1 rank)" "${ratio:-see fsdp_train_$dtype.log}"
  done
fi

stage "summary"
printf '%s\n' "${rows[@]}"
echo "gpu_check: $((SECONDS - began)) s in all"
