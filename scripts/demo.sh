#!/usr/bin/env bash
# README command 1: install what is missing, build, and run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
./build/apps/troupe train --demo "$@"
