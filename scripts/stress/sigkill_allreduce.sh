#!/usr/bin/env bash
# Runs collective's "a SIGKILLed rank fails every survivor's allreduce naming it over UCX" again and
# again: 4 ranks (processes forked by run_local_ranks) start a 64 MiB allreduce and rank 2 kills
# itself inside it. The survivors must fail naming rank 2. They used to hang, rarely (7 of ~250
# runs under heavy compile load), until the test's 60 s bound: the loop's stacks showed a rank's
# endpoint error callback, run by UCX inside ucp_tag_send_nbx with the worker lock held, waiting
# for the progress lock that the progress thread held while it waited for the worker lock (fixed
# in collective/ucx/ucx_transport.cpp: 0 of 250 since, under the same load). An iteration still
# running after LIMIT seconds has every thread's stack of each rank process dumped (gdb -batch
# 'thread apply all bt', and the owner of any mutex a thread waits on) into the log folder, then
# the loop waits for the test to end and stops with status 1.
#
#   scripts/stress/sigkill_allreduce.sh [ITERATIONS [LIMIT_S [BUILD_DIR]]]   (defaults: 300 25 build)
#
# Load makes it likelier: run it beside a build (cmake --build build -j2) or spinning processes.
set -u
iterations=${1:-300}
limit_s=${2:-25}
build=${3:-build}
bin=$build/collective/troupe_collective_tests
test_name="a SIGKILLed rank fails every survivor's allreduce naming it over UCX"
log_dir=${LOG_DIR:-/tmp/troupe-sigkill-allreduce-$$}
mkdir -p "$log_dir"
failed=0
for i in $(seq 1 "$iterations"); do
  "$bin" "$test_name" >"$log_dir/iter.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 "$limit_s"); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "iteration $i: still running after ${limit_s} s; stacks in $log_dir/stacks-$i.txt"
    for p in $(pgrep -P "$pid"); do
      echo "=== rank process $p" >>"$log_dir/stacks-$i.txt"
      gdb -p "$p" -batch -ex "thread apply all bt" >"$log_dir/one.txt" 2>&1
      cat "$log_dir/one.txt" >>"$log_dir/stacks-$i.txt"
      # A thread blocked on a mutex: which thread holds it (glibc: __owner at offset 8).
      for m in $(grep -o 'lll_lock_wait (futex=futex@entry=0x[0-9a-f]*' "$log_dir/one.txt" |
        grep -o '0x[0-9a-f]*$' | sort -u); do
        echo "mutex $m owner:" >>"$log_dir/stacks-$i.txt"
        gdb -p "$p" -batch -ex "p *(int*)($m+8)" >>"$log_dir/stacks-$i.txt" 2>&1
      done
    done
    wait "$pid"
    cp "$log_dir/iter.log" "$log_dir/iter-$i.log"
    exit 1
  fi
  if ! wait "$pid"; then
    failed=$((failed + 1))
    cp "$log_dir/iter.log" "$log_dir/iter-$i.log"
    echo "iteration $i: failed ($log_dir/iter-$i.log)"
  fi
done
echo "$iterations iterations, $failed failed"
[ "$failed" -eq 0 ]
