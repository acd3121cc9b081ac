#!/usr/bin/env bash
# Installs libtorch (headers, libraries, CMake files) from the pinned `torch` wheel of the
# package index into a cache outside the clone, once. Later clones and CI runs reuse it.
#
#   scripts/install_libtorch.sh           # CPU libraries only (what the build and tests need)
#   MDIST_WITH_CUDA=1 scripts/install_libtorch.sh   # also the CUDA/NCCL libraries
#
# Prints the libtorch root on its last line. A user's own libtorch is used instead when
# MDIST_LIBTORCH points at it (or pass -DTorch_DIR=... to CMake and skip this script).
set -euo pipefail

TORCH_VERSION=2.15.0
# sha256 of torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl: a changed file is refused.
TORCH_WHEEL_SHA256=48c2d861134c0b5697c7602cb5ffa68f62a2989fdcd1717e593356f67996ca1e

if [[ -n "${MDIST_LIBTORCH:-}" ]]; then
  if [[ ! -f "$MDIST_LIBTORCH/include/torch/csrc/api/include/torch/torch.h" ]]; then
    echo "install_libtorch: MDIST_LIBTORCH=$MDIST_LIBTORCH does not look like a libtorch root (no include/torch/csrc/api/include/torch/torch.h)" >&2
    exit 1
  fi
  echo "$MDIST_LIBTORCH"
  exit 0
fi

cache="${MDIST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mdist}"
root="$cache/libtorch-$TORCH_VERSION"
want_cuda="${MDIST_WITH_CUDA:-0}"

have_cpu() { [[ -f "$root/.complete-cpu" ]]; }
have_cuda() { [[ -f "$root/.complete-cuda" ]]; }
if have_cpu && { [[ "$want_cuda" != 1 ]] || have_cuda; }; then
  echo "$root"
  exit 0
fi

mkdir -p "$cache"
exec 9>"$cache/.install.lock"
flock 9 # two clones installing at once take turns

wheel_dir="$cache/wheel-download"
mkdir -p "$wheel_dir"
wheel="$wheel_dir/torch-$TORCH_VERSION-cp311-cp311-manylinux_2_28_x86_64.whl"
if [[ ! -f "$wheel" ]] || ! echo "$TORCH_WHEEL_SHA256  $wheel" | sha256sum -c --status; then
  echo "install_libtorch: downloading torch==$TORCH_VERSION wheel (about 540 MB)" >&2
  rm -f "$wheel"
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi cp311 \
    --platform manylinux_2_28_x86_64 -d "$wheel_dir" "torch==$TORCH_VERSION" >&2
fi
if ! echo "$TORCH_WHEEL_SHA256  $wheel" | sha256sum -c --status; then
  echo "install_libtorch: $wheel does not match the pinned sha256; refusing it" >&2
  exit 1
fi

# Only what a C++ build needs: headers, CMake files and the shared libraries.
members=('torch/include/*' 'torch/share/cmake/*' 'torch/lib/libc10.so' 'torch/lib/libtorch_cpu.so'
  'torch/lib/libtorch.so' 'torch/lib/libgomp.so.1' 'torch/lib/libshm.so')
if [[ "$want_cuda" == 1 ]]; then
  members+=('torch/lib/libc10_cuda.so' 'torch/lib/libtorch_cuda.so' 'torch/lib/libtorch_cuda_linalg.so'
    'torch/lib/libtorch_nvshmem.so' 'torch/lib/libcaffe2_nvrtc.so' 'torch/lib/libtorch_global_deps.so')
fi
tmp="$(mktemp -d "$cache/.extract.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
echo "install_libtorch: extracting into $root" >&2
unzip -q -o "$wheel" "${members[@]}" -d "$tmp"
mkdir -p "$root"
for d in include share lib; do
  # Whole directories are swapped in with a rename so a crash never leaves half a tree.
  if [[ -d "$root/$d" && "$d" == lib ]]; then
    cp -a "$tmp/torch/lib/." "$root/lib/"
  else
    rm -rf "$root/$d.old"
    [[ -d "$root/$d" ]] && mv "$root/$d" "$root/$d.old"
    mv "$tmp/torch/$d" "$root/$d"
    rm -rf "$root/$d.old"
  fi
done
echo "$TORCH_VERSION" >"$root/VERSION"
touch "$root/.complete-cpu"
[[ "$want_cuda" == 1 ]] && touch "$root/.complete-cuda"
rm -f "$wheel" # the extracted tree is what is kept; the wheel is fetched again only if needed
echo "$root"
