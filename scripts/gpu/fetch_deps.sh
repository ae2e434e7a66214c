#!/usr/bin/env bash
# Downloads the Debian 12 packages that a build of troupe needs beyond what the lent GPU machine's
# image has (CUDA toolkit, CMake, ninja, a C++ compiler, PyTorch; no package registry there), so
# that scripts/gpu/check.sh can unpack them into a local prefix there (docs/gpu.md).
#
#   bash scripts/gpu/fetch_deps.sh [DIR]      (default DIR: carry/gpu-debs, ignored by git)
#
# Run it here, before the device call, as root or as a user apt-get may download as. It replaces
# DIR's .deb files with this list's current versions, writes DIR/MANIFEST (package, version,
# bytes), prints the total, and fails when the working tree plus DIR would not travel (the device
# tool carries at most 64 MiB in all). Nothing is installed here.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-carry/gpu-debs}
limit_mib=64

# What troupe's CMake finds (CMakeLists.txt, */CMakeLists.txt, cmake/FindCAF.cmake), the -dev
# packages with their run-time libraries, and what those libraries load in turn. Left out: what
# any image with a compiler has (libc6-dev, libstdc++, libgcc-s1, linux-libc-dev), ibverbs-providers
# (UCX's InfiniBand module only; no such hardware there), and the packages of the tests that a
# [gpu] run does not reach (chromium, fio, iproute2).
pkgs=(
  libcaf-dev libcaf-core0.17 libcaf-io0.17 libcaf-openssl0.17   # actors (CAF 0.17, TLS module)
  libucx-dev libucx0 libnuma1 libibverbs1 librdmacm1            # collective/ucx; libucx0's needs
  liburing-dev liburing2                                        # memory/io
  libopenblas-dev libopenblas-pthread-dev libopenblas0-pthread libopenblas0 libgfortran5
  libquadmath0                                                  # libgfortran5 loads it
  libssl-dev libssl3                                            # collective/auth, actors/tls
  libboost1.74-dev                                              # actors: boost/asio.hpp only
  libtomlplusplus-dev libtomlplusplus3                          # job files
  libcli11-dev nlohmann-json3-dev libfmt-dev libfmt9            # apps, models
  libsentencepiece-dev libsentencepiece0                        # models/text
  catch2                                                        # the test binaries
  pkgconf pkgconf-bin libpkgconf3                               # pkg_check_modules (uring, spm)
)

arch=$(dpkg --print-architecture)
if [ "$arch" != amd64 ]; then
  echo "fetch_deps: this machine is $arch; the GPU machine is amd64 (x86-64): fetch there from an amd64 machine" >&2
  exit 1
fi
if ! apt-cache show "${pkgs[0]}" >/dev/null 2>&1; then
  echo "fetch_deps: apt knows no ${pkgs[0]}: running apt-get update"
  apt-get update -qq
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"   # apt's _apt user writes the files when it can
( cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root "${pkgs[@]}" >download.log 2>&1 ) || {
  echo "fetch_deps: apt-get download failed:" >&2
  tail -20 "$tmp/download.log" >&2
  exit 1
}
mkdir -p "$dir"
rm -f "$dir"/*.deb "$dir/MANIFEST"
mv "$tmp"/*.deb "$dir"/
for f in "$dir"/*.deb; do
  printf '%s %s %s\n' "$(dpkg-deb -f "$f" Package)" "$(dpkg-deb -f "$f" Version)" \
    "$(stat -c %s "$f")"
done >"$dir/MANIFEST"
count=$(ls "$dir"/*.deb | wc -l)
if [ "$count" -ne "${#pkgs[@]}" ]; then
  echo "fetch_deps: asked for ${#pkgs[@]} packages, got $count .deb files in $dir" >&2
  exit 1
fi

# What the device tool sends: tracked and untracked-not-ignored files (shared/ among them when the
# checkout has one), plus the carried paths.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard |
  xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
debs_bytes=$(awk '{s += $3} END {print s + 0}' "$dir/MANIFEST")
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
total=$((tree_bytes + debs_bytes))
echo "fetch_deps: $count packages in $dir: $(mib "$debs_bytes") MiB;" \
  "working tree $(mib "$tree_bytes") MiB; together $(mib "$total") of $limit_mib MiB"
if [ "$total" -gt $((limit_mib * 1048576)) ]; then
  echo "fetch_deps: over the device tool's $limit_mib MiB: the call would be refused." >&2
  echo "  largest packages:" >&2
  sort -k3 -n -r "$dir/MANIFEST" | head -5 | sed 's/^/    /' >&2
  exit 1
fi
