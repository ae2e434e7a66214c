#!/usr/bin/env bash
# Checks the module dependency table of ARCHITECTURE.md against the #include lines of every module:
# a module may include only the project modules and third-party headers its row allows.
set -euo pipefail
cd "$(dirname "$0")/.."
# module | project modules it may include | forbidden third-party include prefixes
table=(
  "memory|memory|caf/ ucp/ uct/ ucs/ nccl.h"
  "tensor|tensor memory|caf/ ucp/ uct/ ucs/ nccl.h liburing.h"
  "collective|collective tensor memory|caf/"
  "scheduler|scheduler|caf/ ucp/ nccl.h liburing.h cuda"
  "models|models scheduler collective tensor memory|caf/ ucp/ uct/ ucs/ nccl.h"
  "actors|actors scheduler models collective tensor/tensor.hpp tensor/dtype.hpp tensor/ops.hpp memory|ucp/ uct/ ucs/ nccl.h"
)
modules="memory tensor collective scheduler models actors apps"
bad=0
for row in "${table[@]}"; do
  IFS='|' read -r mod allowed forbidden <<<"$row"
  [ -d "$mod" ] || continue
  while IFS= read -r hit; do
    file=${hit%%:*}
    inc=$(sed -E 's/.*#include[[:space:]]*[<"]([^">]+)[">].*/\1/' <<<"${hit#*:}")
    top=${inc%%/*}
    if [[ " $modules " == *" $top "* && "$inc" == */* ]]; then
      ok=0
      for a in $allowed; do
        [[ "$inc" == "$a" || "$inc" == "$a"/* ]] && ok=1
      done
      if [ "$ok" -eq 0 ]; then
        echo "deps: $file includes $inc, but $mod may include only: $allowed"
        bad=1
      fi
    fi
    for f in $forbidden; do
      if [[ "$inc" == "$f"* ]]; then
        echo "deps: $file includes $inc, which $mod must not depend on"
        bad=1
      fi
    done
  done < <(grep -rnE '^[[:space:]]*#[[:space:]]*include' "$mod" --include='*.hpp' --include='*.cpp' \
             --include='*.cu' --include='*.cuh' --include='*.h' | sed -E 's/^([^:]+):[0-9]+:/\1:/')
done
[ "$bad" -eq 0 ] && echo "deps: every module respects the dependency table"
exit "$bad"
