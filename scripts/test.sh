#!/usr/bin/env bash
# README command 2: install what is missing, build, and run the whole test suite. Tests that need a
# GPU report "Skipped" on machines without one. It builds with the same settings as README command
# 1 (scripts/demo.sh), so after the demo only the test binaries are left to build; CI adds
# warnings as errors with TROUPE_WERROR=ON.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh -DTROUPE_WERROR="${TROUPE_WERROR:-OFF}"
ctest --test-dir build --output-on-failure -j "$(nproc)" "$@"
