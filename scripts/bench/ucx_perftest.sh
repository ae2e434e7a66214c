#!/usr/bin/env bash
# Baseline for troupe's UCX data plane: runs ucx_perftest server + client on this machine, each
# pinned to its own core, with the transport settings troupe's ucx_transport uses by default, and
# prints MB/s (1 MB = 2^20 bytes, as ucx_perftest prints it) and GB/s (1e9 bytes/s, as troupe does).
#
# usage: scripts/bench/ucx_perftest.sh [repetitions]
#   env: UCX_TLS (default: troupe's default, see collective/ucx/README.md), UCX_NET_DEVICES (lo),
#        SERVER_CPU (1), CLIENT_CPU (0), PORT (13400 + random).
# Tests: tag_bw 4 MiB and 64 MiB (one message outstanding, like troupe's window of 1 and the
# default of ucx_perftest), tag_lat 8 B (one-way latency = round trip / 2).
set -euo pipefail
reps=${1:-3}
export UCX_TLS=${UCX_TLS:-self,sysv,posix,tcp}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
server_cpu=${SERVER_CPU:-1}
client_cpu=${CLIENT_CPU:-0}
port=${PORT:-$((13400 + RANDOM % 500))}
command -v ucx_perftest >/dev/null || { echo "ucx_perftest not found (apt-get install ucx-utils)"; exit 1; }

# run_one TEST SIZE ITERS WARMUP -> prints the final line's fields
run_one() {
  local test=$1 size=$2 iters=$3 warmup=$4 out
  taskset -c "$server_cpu" ucx_perftest -p "$port" >/dev/null 2>&1 &
  local server=$!
  # the server needs a moment to listen; retry the client a few times
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    sleep 0.2
    if out=$(taskset -c "$client_cpu" ucx_perftest 127.0.0.1 -p "$port" -t "$test" -s "$size" \
               -n "$iters" -w "$warmup" -f 2>&1); then
      break
    fi
  done
  wait "$server" || true
  # columns of the final line: iterations, lat p50, lat avg, lat overall, MB/s avg, MB/s overall, ...
  tail -n 1 <<<"$out"
}

echo "UCX_TLS=$UCX_TLS UCX_NET_DEVICES=$UCX_NET_DEVICES server cpu $server_cpu, client cpu $client_cpu"
for rep in $(seq 1 "$reps"); do
  for size in 4194304 67108864; do
    iters=$((size > 8388608 ? 100 : 1000))
    line=$(run_one tag_bw "$size" "$iters" 10)
    mbs=$(awk '{print $6}' <<<"$line")
    awk -v s="$size" -v m="$mbs" -v r="$rep" \
      'BEGIN {printf "rep %d tag_bw %8d B: %9.1f MB/s  (%6.2f GB/s)\n", r, s, m, m * 1048576 / 1e9}'
  done
  line=$(run_one tag_lat 8 100000 1000)
  lat=$(awk '{print $4}' <<<"$line")
  echo "rep $rep tag_lat        8 B: $lat us (one way, overall average)"
done
