#!/usr/bin/env bash
# Builds the CUDA variant (libtorch_cuda, NCCL backend) into build-cuda/. On a machine with a
# CUDA toolkit but no GPU this is a compile-and-link check; on a GPU machine it gives
# build-cuda/bin/ programs that use NCCL for CUDA tensors ("cpu:gloo,cuda:nccl"), gpu_test among them
# (scripts/gpu_check.sh is the whole check on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvcc >/dev/null 2>&1 && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "build_cuda: no CUDA toolkit (nvcc) found; skipping the CUDA build" >&2
  exit 0
fi
libtorch="$(MDIST_WITH_CUDA=1 scripts/install_libtorch.sh | tail -n 1)"
cmake -S . -B build-cuda -DMDIST_LIBTORCH="$libtorch" -DMDIST_WITH_CUDA=ON \
  -DCUDAToolkit_ROOT="${CUDAToolkit_ROOT:-/usr/local/cuda}" -DMDIST_BUILD_TESTS=ON \
  -DMDIST_BUILD_BENCH=ON >/dev/null
cmake --build build-cuda -j "$(nproc)" --target mdist mdist-demo mdistrun mdist_cli gpu_test fsdp_train
echo "build_cuda: built build-cuda/lib/libmdist.so with NCCL support" >&2
