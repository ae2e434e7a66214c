#!/usr/bin/env bash
# Pipeline schedules side by side (issue 6's bubble goal): gpt2-demo B=8 T=128 at pp 2 with 8
# microbatches, 2 ranks x 1 thread, STEPS steps per run; each round runs every schedule once, in
# turn, so a drift of the shared machine's speed hits them alike. Every run is traced
# (--pipe-trace) and scripts/bench/pipe_trace.py reads the bubble on one clock (idle over
# stages x makespan, the definition of (p-1)/(m+p-1)) and its replay with the measured compute
# times and free transfers (what the schedule implies for them). Prints each run, then per
# schedule the median, the lowest and the highest of tokens/s, one clock and replay.
#
#   bash scripts/bench/pipe_schedules.sh [build-dir] [steps] [rounds] [schedule ...]
#   (defaults: build 80 8 eager-1f1b zero-bubble)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
STEPS=${2:-80}
ROUNDS=${3:-8}
shift $(($# < 3 ? $# : 3))
SCHEDULES=("$@")
[ ${#SCHEDULES[@]} -gt 0 ] || SCHEDULES=(eager-1f1b zero-bubble)
T="$BUILD/apps/troupe"
trace=/tmp/troupe-pipe-schedules-$$
results=$(mktemp)
trap 'rm -f "$trace"-*.* "$results"' EXIT
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for ((r = 1; r <= ROUNDS; r++)); do
  for s in "${SCHEDULES[@]}"; do
    rm -f "$trace"-*.*
    out=$("$T" launch -n 2 --job "pipe-$s-$$" -- "$T" train --pipe-trace "$trace-run" \
      --model gpt2-demo --batch 8 --seq 128 --steps "$STEPS" --sample 0 --log-every 1000 \
      --threads 1 --pp 2 --microbatches 8 --schedule "$s" 2>&1)
    tps=$(echo "$out" | grep 'trained to step' | grep -o '([0-9]* tokens/s)' | tr -dc '0-9')
    rep=$(python3 scripts/bench/pipe_trace.py "$trace-run")
    one=$(echo "$rep" | grep 'one clock' | grep -o 'bubble [0-9.]*' | awk '{print $2}')
    replay=$(echo "$rep" | grep 'replay with the measured' | grep -o 'bubble [0-9.]*' |
      awk '{print $2}')
    printf 'round %d %-12s %6s tokens/s  one clock %5s%%  replay %5s%%\n' "$r" "$s" "$tps" "$one" \
      "$replay"
    echo "$s $tps $one $replay" >>"$results"
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$results" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    s, tps, one, replay = line.split()
    rows.setdefault(s, []).append((float(tps), float(one), float(replay)))
print("theory (p-1)/(m+p-1) = 11.1%; the goal (within 10% of it): at most 12.2%")
for s, v in rows.items():
    cols = list(zip(*v))
    f = lambda c, fmt: f"{fmt % statistics.median(c)} ({fmt % min(c)} to {fmt % max(c)})"
    print(f"{s}: {len(v)} runs, tokens/s {f(cols[0], '%.0f')}, one clock {f(cols[1], '%.1f%%')}, "
          f"replay {f(cols[2], '%.1f%%')}")
PY
