#!/usr/bin/env bash
# README command 1: install what is missing, build, and run the main job: a small GPT trained on
# the fortunes corpus by 4 local ranks as 2 data-parallel replicas x 2 pipeline stages (1F1B, 4
# microbatches), a trainer actor per rank driven from rank 0, the whole model checkpointed in HF
# layout at the end and sampled. Extra arguments go to `troupe train` (e.g. --steps 50).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh -DTROUPE_WERROR="${TROUPE_WERROR:-OFF}"
./build/apps/troupe launch -n 4 -- ./build/apps/troupe train --demo --dp 2 --pp 2 \
  --microbatches 4 --checkpoint-dir /tmp/troupe-demo "$@"
