#!/usr/bin/env bash
# Installs the Debian packages mdist builds and tests with, when any is missing.
set -euo pipefail

packages=(
  cmake g++ make ccache unzip       # build
  libgtest-dev libgmock-dev         # tests
  iproute2                          # ip netns: two "nodes" on one machine (tests/multinode)
  libbenchmark-dev                  # bench/
  libgloo-dev                       # Gloo headers: the torch wheel ships libgloo inside libtorch_cpu, no headers
  libcli11-dev                      # command-line parsing (mdistrun)
  nlohmann-json3-dev                # JSON (safetensors headers, src/hf/)
  libpcre2-dev libutf8proc-dev      # tokenizer.json: Unicode regexes (PCRE2 JIT), normalization (NFC/NFKC)
  pkgconf                           # CMake finds PCRE2 and utf8proc through pkg-config
  clang libclang-rt-14-dev          # libFuzzer targets (fuzz/)
)

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if ! python3 -m pip --version >/dev/null 2>&1; then
  missing+=(python3-pip) # pip fetches the pinned torch wheel (scripts/install_libtorch.sh)
fi
if ((${#missing[@]} == 0)); then
  exit 0
fi

sudo=()
if [[ $(id -u) != 0 ]]; then
  sudo=(sudo)
fi
echo "install_deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -q >&2
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
