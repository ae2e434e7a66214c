#!/usr/bin/env bash
# Fails when a tracked C++/CUDA source differs from what clang-format (.clang-format) would write.
set -euo pipefail
cd "$(dirname "$0")/.."
bad=0
while IFS= read -r f; do
  if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then
    echo "format: $f differs from clang-format (run: clang-format -i $f)"
    bad=1
  fi
done < <(git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh' '*.h')
[ "$bad" -eq 0 ] && echo "format: all sources match .clang-format"
exit "$bad"
