#!/usr/bin/env bash
# The CPU unit tests under AddressSanitizer + UndefinedBehaviorSanitizer (CUDA off: the sanitizers
# check host code).
set -euo pipefail
cd "$(dirname "$0")/.."
TROUPE_BUILD_DIR=build-asan bash scripts/build.sh -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTROUPE_SANITIZE=ON -DTROUPE_ENABLE_CUDA=OFF -DTROUPE_WERROR=ON
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j "$(nproc)" -L unit "$@"
