#!/usr/bin/env bash
# README command 2: install what is missing, build, and run the whole test suite. Tests that need a
# GPU report "Skipped" on machines without one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh -DTROUPE_WERROR=ON
ctest --test-dir build --output-on-failure -j "$(nproc)" "$@"
