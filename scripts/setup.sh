#!/usr/bin/env bash
# Installs what troupe needs on Debian 12 (apt-get; as root, or through sudo). Safe to re-run:
# it installs only what is missing.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config ccache git clang-format
      libcaf-dev libucx-dev ucx-utils liburing-dev libboost-dev libopenblas-dev libssl-dev
      catch2 libtomlplusplus-dev libcli11-dev nlohmann-json3-dev libfmt-dev libsentencepiece-dev
      iproute2 fortunes fio   # iproute2: the two-host netns test; fortunes: the demo corpus
      chromium fonts-dejavu-core  # the dashboard's browser test (headless) and its screenshot
      openssl)  # the TLS test makes a self-signed certificate and probes the port
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "troupe setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
