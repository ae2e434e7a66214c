#!/usr/bin/env bash
# Runs the roles example under `troupe launch -n 4` again and again, with `troupe ps` probing the
# job while it runs, under a watchdog: an iteration that runs past LIMIT seconds has every thread's
# stack of the launcher and each of its ranks dumped (gdb -batch 'thread apply all bt') into the
# log folder, then the job is killed and the loop stops with status 1. Hunts rare shutdown hangs.
#
#   scripts/stress/roles_loop.sh [ITERATIONS [LIMIT_S [BUILD_DIR]]]    (defaults: 50 120 build)
#   LOG_DIR=/tmp/roles-loop HOLD=1 scripts/stress/roles_loop.sh 200
#
# HOLD=S passes --hold S to the example (the job stays up S s more: more probes land while it
# runs). PROBERS=N probes with N `troupe ps` loops at once (default 1), back to back.
#
# A failed iteration (not a hang) is counted and kept, and the loop goes on; it exits 1 at the end
# if any failed. Each iteration's output goes to $LOG_DIR/iter-N.log (kept only when it fails or
# hangs). Run it
# niced on a shared machine (nice -n 10 ...); a spinning process on another core makes schedules
# more varied.
set -u
iterations=${1:-50}
limit_s=${2:-120}
build=${3:-build}
troupe=$build/apps/troupe
example=$build/apps/examples/troupe_example_roles
log_dir=${LOG_DIR:-/tmp/troupe-roles-loop-$$}
hold=${HOLD:-0}
probers=${PROBERS:-1}
mkdir -p "$log_dir"
for f in "$troupe" "$example"; do
  [[ -x $f ]] || { echo "roles_loop: $f is missing (build troupe and troupe_example_roles)"; exit 2; }
done
command -v gdb >/dev/null || echo "roles_loop: gdb is missing: a hang is reported without stacks"

# The launcher and every process below it.
descendants() {
  local p=$1
  echo "$p"
  for c in $(pgrep -P "$p"); do descendants "$c"; done
}

dump_stacks() {
  local out=$1 launcher=$2
  for p in $(descendants "$launcher"); do
    {
      echo "=== pid $p: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null)"
      gdb -p "$p" -batch -ex 'thread apply all bt' 2>&1 | grep -v '^\[New LWP'
    } >>"$out"
  done
}

# Probes the job until the launcher ends: the answers do not matter (the job may not be
# registered yet, or be leaving), only that probing never wedges the job. Counts the answers.
probe() {
  local job=$1 launcher=$2 count=$3 n=0
  while kill -0 "$launcher" 2>/dev/null; do
    timeout 10 "$troupe" ps --job "$job" >/dev/null 2>&1 && n=$((n + 1))
  done
  echo "$n" >"$count"
}

failed=0
for ((i = 1; i <= iterations; i++)); do
  job=roles-loop-$$-$i
  log=$log_dir/iter-$i.log
  args=()
  ((hold > 0)) && args=(--hold "$hold")
  "$troupe" launch -n 4 --job "$job" -- "$example" "${args[@]}" >"$log" 2>&1 &
  launcher=$!
  start=$SECONDS
  probe_pids=()
  for ((k = 0; k < probers; k++)); do
    probe "$job" "$launcher" "$log_dir/probes-$k" &
    probe_pids+=($!)
  done
  hung=0
  while kill -0 "$launcher" 2>/dev/null; do
    if ((SECONDS - start > limit_s)); then
      hung=1
      break
    fi
    sleep 1  # the watchdog's pace, not a synchronisation
  done
  if ((hung)); then
    stacks=$log_dir/hang-$i.stacks
    echo "roles_loop: iteration $i still runs after ${limit_s} s: stacks in $stacks, output in $log"
    dump_stacks "$stacks" "$launcher"
    for p in $(descendants "$launcher"); do kill -KILL "$p" 2>/dev/null; done
    wait "$launcher" 2>/dev/null
    wait "${probe_pids[@]}"
    exit 1
  fi
  wait "$launcher"
  rc=$?
  wait "${probe_pids[@]}"
  probes=0
  for ((k = 0; k < probers; k++)); do probes=$((probes + $(cat "$log_dir/probes-$k"))); done
  if ((rc != 0)) || ! grep -q '(match)' "$log"; then
    echo "roles_loop: iteration $i failed (exit $rc): output in $log"
    failed=$((failed + 1))
    continue
  fi
  echo "roles_loop: iteration $i ok in $((SECONDS - start)) s ($probes ps answers)"
  rm -f "$log"
done
echo "roles_loop: $iterations iterations, none hung, $failed failed"
((failed == 0))
