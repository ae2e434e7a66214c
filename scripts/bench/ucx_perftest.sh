#!/usr/bin/env bash
# Baseline for troupe's UCX data plane: runs ucx_perftest server + client on this machine, each
# pinned to its own core, with the UCX settings troupe's ucx_transport uses by default, and prints
# MB/s (1 MB = 2^20 bytes, as ucx_perftest prints it) and GB/s (1e9 bytes/s, as troupe does).
# Given troupe's collective test binary, it runs troupe's own p2p benchmark (the hidden test
# "[.ucx-bench]", the same pinning, sizes and iteration counts) right after each ucx_perftest run,
# so both see the same machine load.
#
# usage: scripts/bench/ucx_perftest.sh [repetitions] [path/to/troupe_collective_tests]
#   env: UCX_TLS (default self,sysv,posix,tcp), UCX_MAX_RNDV_RAILS (0), UCX_NET_DEVICES (lo):
#        troupe's defaults; SERVER_CPU (1), CLIENT_CPU (0), PORT (13400 + random);
#        TROUPE_P2P_PROGRESS (1: troupe's progress thread on); PRIO: a command prefix for both
#        (e.g. PRIO="chrt -f 10": SCHED_FIFO, so that other jobs on a shared 2-core machine do not
#        preempt the busy-polling pair; unset = normal priority). Never with tcp carrying data:
#        real-time spinners on every core starve ksoftirqd and a tcp transfer stalls (each run is
#        cut off after 60 s anyway).
# Tests: tag_bw 4 MiB (1000 iterations) and 64 MiB (100), one message outstanding (ucx_perftest's
# default; troupe window 1), and tag_lat 8 B (100000 round trips; one-way latency = RTT / 2).
set -euo pipefail
reps=${1:-3}
troupe_tests=${2:-}
export UCX_TLS=${UCX_TLS:-self,sysv,posix,tcp}
export UCX_MAX_RNDV_RAILS=${UCX_MAX_RNDV_RAILS:-0}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
prio=${PRIO:-}
server_cpu=${SERVER_CPU:-1}
client_cpu=${CLIENT_CPU:-0}
port=${PORT:-$((13400 + RANDOM % 500))}
command -v ucx_perftest >/dev/null || { echo "ucx_perftest not found (apt-get install ucx-utils)"; exit 1; }

# run_one TEST SIZE ITERS WARMUP -> prints ucx_perftest's final line
run_one() {
  local test=$1 size=$2 iters=$3 warmup=$4 out=""
  timeout 60 $prio taskset -c "$server_cpu" ucx_perftest -p "$port" >/dev/null 2>&1 &
  local server=$!
  # the server needs a moment to listen; retry the client a few times
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    sleep 0.2
    if out=$(timeout 60 $prio taskset -c "$client_cpu" ucx_perftest 127.0.0.1 -p "$port" -t "$test" -s "$size" \
               -n "$iters" -w "$warmup" -f 2>&1); then
      break
    fi
  done
  wait "$server" || true
  # columns: iterations, latency p50, latency avg, latency overall (us), MB/s avg, MB/s overall, ...
  tail -n 1 <<<"$out"
}

run_troupe() {
  [ -n "$troupe_tests" ] || return 0
  TROUPE_P2P="$1" timeout 120 $prio "$troupe_tests" "[.ucx-bench]" | grep '^troupe' |
    sed 's/^/        /'
}

echo "UCX_TLS=$UCX_TLS UCX_MAX_RNDV_RAILS=$UCX_MAX_RNDV_RAILS UCX_NET_DEVICES=$UCX_NET_DEVICES"
echo "server cpu $server_cpu, client cpu $client_cpu (troupe: rank 0 on the first allowed cpu, rank 1 on the second)${prio:+, under '$prio'}"
for rep in $(seq 1 "$reps"); do
  for size in 4194304 67108864; do
    iters=$((size > 8388608 ? 100 : 1000))
    line=$(run_one tag_bw "$size" "$iters" 10)
    awk -v s="$size" -v r="$rep" '{printf "rep %d ucx_perftest tag_bw %d B: %.1f MB/s (%.2f GB/s)\n",
                                    r, s, $6, $6 * 1048576 / 1e9}' <<<"$line"
    run_troupe "$size"
  done
  line=$(run_one tag_lat 8 100000 1000)
  awk -v r="$rep" '{printf "rep %d ucx_perftest tag_lat 8 B: %.3f us\n", r, $4}' <<<"$line"
  run_troupe lat
done
