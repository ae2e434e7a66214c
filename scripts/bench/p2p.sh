#!/usr/bin/env bash
# troupe's actor runtime between two processes against its baselines, in one invocation:
#   1. scripts/bench/ucx_perftest.sh: ucx_perftest tag_bw at 4 MiB and 64 MiB (one message
#      outstanding), server and client pinned to their own CPUs, troupe's UCX settings;
#   2. troupe bench p2p --json: job.ask round trips next to bare CAF requests, and tensors by handle
#      next to the raw UCX transport (both ranks pinned the same way).
# Prints the ratios the actor runtime is held to: by-handle bandwidth / ucx_perftest bandwidth
# (goal >= 0.90) and troupe request round trip / bare CAF round trip (goal <= 2).
#
# usage: scripts/bench/p2p.sh [build dir (default build)] [ucx_perftest repetitions (default 3)]
#   env: PRIO, a command prefix for both benchmarks, e.g. PRIO="chrt -f 10" (SCHED_FIFO, so that
#        other jobs on a shared 2-core machine do not preempt the pinned pairs), as
#        scripts/bench/ucx_perftest.sh takes it.
# The machine is shared and noisy: run it when nothing else runs, and compare within one run.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
reps=${2:-3}
troupe="$build/apps/troupe"
[ -x "$troupe" ] || { echo "p2p.sh: $troupe not found (build the troupe target)"; exit 1; }

perf=$(mktemp)
report=$(mktemp)
trap 'rm -f "$perf" "$report"' EXIT

echo "== ucx_perftest (scripts/bench/ucx_perftest.sh $reps)"
scripts/bench/ucx_perftest.sh "$reps" | tee "$perf"
echo
echo "== troupe bench p2p"
timeout 600 ${PRIO:-} "$troupe" bench p2p --json >"$report"

python3 - "$perf" "$report" <<'EOF'
import json, re, statistics, sys
perf = {}
for line in open(sys.argv[1]):
    m = re.search(r"ucx_perftest tag_bw (\d+) B: [0-9.]+ MB/s \(([0-9.]+) GB/s\)", line)
    if m:
        perf.setdefault(int(m.group(1)), []).append(float(m.group(2)))
r = json.load(open(sys.argv[2]))
t, c = r["rtt"]["troupe_ask"], r["rtt"]["bare_caf"]
print(f"request round trip, {r['rtt']['samples']} samples each      p50 us   p99 us")
print(f"  troupe job.ask to a role actor              {t['p50_us']:8.1f} {t['p99_us']:8.1f}")
print(f"  bare CAF request (same actor systems)       {c['p50_us']:8.1f} {c['p99_us']:8.1f}")
ratio = t["p50_us"] / c["p50_us"]
print(f"  troupe / CAF (p50)                          {ratio:8.2f}   goal <= 2: "
      f"{'met' if ratio <= 2 else 'NOT met'}")
print()
print("tensor by handle, GB/s (1e9 B/s)   ucx_perftest  raw transport  w1     w1 pre-posted  "
      f"w{r['bandwidth'][0]['by_handle_window']}")
for b in r["bandwidth"]:
    size = b["bytes"]
    ref = statistics.median(perf.get(size, [float("nan")]))
    w1, w1d, wn = (b["by_handle_w1_gbps"], b["by_handle_w1_data_only_gbps"],
                   b["by_handle_wn_gbps"])
    best = max(w1, w1d, wn)
    print(f"  {size >> 20:3d} MiB                        {ref:8.2f}      "
          f"{b['raw_transport_gbps']:8.2f}   {w1:6.2f}  {w1d:6.2f}         {wn:6.2f}")
    print(f"    / ucx_perftest                           "
          f"{b['raw_transport_gbps'] / ref:8.2f}   {w1 / ref:6.2f}  {w1d / ref:6.2f}         "
          f"{wn / ref:6.2f}   goal >= 0.90: {'met' if best / ref >= 0.9 else 'NOT met'}")
print()
print(f"UCX: {r.get('transports', '?')}")
EOF
