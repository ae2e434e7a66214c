#!/usr/bin/env bash
# Hybrid-parallel throughput on this machine (issue 6's benchmark): the small GPT (gpt2-demo,
# B=8 T=128) trained for STEPS steps as 1 rank x 2 threads and as 2 ranks x 1 thread each with
# dp2, tp2 and pp2 (1F1B, 8 microbatches), in the same run; tokens/s of each next to the single
# process, the pipeline bubble next to (p-1)/(m+p-1), and the share of the gradient allreduce that
# overlap hides behind backward (dp2 with and without overlap, 256 KiB gradient buckets).
#
# The pp2 run is traced (--pipe-trace, see models/parallel/pipeline_runner.hpp) and run four
# times:
# with the list's transfer batches waited where they stand (--pipe-p2p batched, Megatron's
# batch_isend_irecv) and with the runner's default (sends never waited in place, receives posted
# one compute action ahead), and a third time with the eager 1F1B schedule (scheduler/pipeline.hpp:
# one more microbatch in flight per link, the runner's default transfers; same ideal bubble), and
# a fourth time with the zero-bubble schedule (eager 1F1B with the backwards of stage 1 split:
# its input gradient goes upstream before its weight gradients are computed).
# scripts/bench/pipe_trace.py then prints, over the steps after the
# first: per stage the mean forward and backward of a microbatch and the bubble of the pipelined
# section and of forward_backward, and the bubble of the same lists replayed with the measured
# compute times and free transfers (what the schedule alone implies), next to (p-1)/(m+p-1), and
# the same replay with the compute actions' thread CPU times (the stages' own cost, without what
# other processes of a shared machine took from them). The load average is printed before and
# after: on the shared 2-vCPU machine every figure needs it next to it.
#
#   bash scripts/bench/hybrid.sh [build-dir] [steps]
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
STEPS=${2:-40}
T="$BUILD/apps/troupe"
common=(train --model gpt2-demo --batch 8 --seq 128 --steps "$STEPS" --sample 0 --log-every 1000)
tps() { grep -o '([0-9]* tokens/s)' | tr -dc '0-9'; }
field() { grep -o "$1 [0-9.]*" | awk '{print $NF}'; }

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
single=$("$T" "${common[@]}" --threads 2 | tps)
echo "1 rank x 2 threads: $single tokens/s"
# The knobs (gradient buckets and overlap, pipeline transfers, traces) are troupe train flags
# (the [parallel] table of a job file): every rank gets them on its command line.
run() {  # name, flags...
  local name=$1
  shift
  local out
  out=$("$T" launch -n 2 --job "bench-$name-$$" -- "$T" "${common[@]}" --threads 1 "$@" 2>&1)
  local t
  t=$(echo "$out" | grep 'trained to step' | tps)
  echo "$out" | grep 'trained to step' | sed 's/^\[rank 0\] //' >"/tmp/troupe-bench-$name.txt"
  printf '%-22s %6s tokens/s  %.2fx the single process\n' "2 ranks x 1 thread $name:" "$t" \
    "$(echo "$t / $single" | bc -l)"
}
# 256 KiB gradient buckets (about a third of a block) so that overlap has something to hide.
buckets=(--dp-bucket-bytes 256K)
run dp2 --dp 2 "${buckets[@]}"
run tp2 --tp 2
trace=/tmp/troupe-bench-pipe-$$
rm -f "$trace"-*.*
run pp2-batched --pp 2 --microbatches 8 --pipe-p2p batched --pipe-trace "$trace-batched"
run pp2 --pp 2 --microbatches 8 --pipe-trace "$trace-default"
run pp2-eager --pp 2 --microbatches 8 --schedule eager-1f1b --pipe-trace "$trace-eager"
run pp2-zb --pp 2 --microbatches 8 --schedule zero-bubble --pipe-trace "$trace-zb"
printf 'pp2 m=8: theory (p-1)/(m+p-1) = %.1f%% (1f1b, eager-1f1b; zero-bubble aims below it)\n' \
  "$(echo "100 * 1 / 9" | bc -l)"
for v in pp2-batched pp2 pp2-eager pp2-zb; do
  bubble=$(grep -o 'bubble [0-9.]*' "/tmp/troupe-bench-$v.txt" | awk '{print $2}')
  echo "$v: troupe train reports bubble $bubble% (the larger stage's, steps 1..)"
  case $v in
    pp2-batched) python3 scripts/bench/pipe_trace.py "$trace-batched" ;;
    pp2) python3 scripts/bench/pipe_trace.py "$trace-default" ;;
    pp2-eager) python3 scripts/bench/pipe_trace.py "$trace-eager" ;;
    pp2-zb) python3 scripts/bench/pipe_trace.py "$trace-zb" ;;
  esac
done
rm -f "$trace"-*.*
with=$(grep -o 'collectives [0-9.]*' /tmp/troupe-bench-dp2.txt | awk '{print $2}')
run dp2-no-overlap --dp 2 "${buckets[@]}" --no-dp-overlap >/dev/null
without=$(grep -o 'collectives [0-9.]*' /tmp/troupe-bench-dp2-no-overlap.txt | awk '{print $2}')
printf 'dp2 gradient allreduce wait after backward: %s ms per step with overlap, %s ms without: ' \
  "$with" "$without"
echo "$with $without" | awk '{ if ($2 > 0) printf "%.0f%% hidden\n", 100 * (1 - $1 / $2); else print "n/a" }'
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
