#!/usr/bin/env bash
# Prepares .gpu_deps/ (git-ignored) on this machine for scripts/gpu_check.sh on a GPU machine that
# cannot reach a package registry: the Debian -dev packages mdist builds with (headers, CMake
# files, a few small libraries), unpacked with dpkg -x, not installed. Carry .gpu_deps with the
# working tree; gpu_check.sh points CMake at it.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(nlohmann-json3-dev libcli11-dev libgloo-dev libgtest-dev libgmock-dev
  libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2 pkgconf pkgconf-bin libpkgconf3)
rm -rf .gpu_deps
mkdir -p .gpu_deps/debs
(cd .gpu_deps/debs && apt-get download "${packages[@]}" >/dev/null)
for deb in .gpu_deps/debs/*.deb; do dpkg -x "$deb" .gpu_deps/root; done
rm -rf .gpu_deps/debs .gpu_deps/root/usr/share/doc .gpu_deps/root/usr/share/man
echo "gpu_deps: $(du -sh .gpu_deps | cut -f1) in .gpu_deps/root (carry .gpu_deps)"
