#!/usr/bin/env bash
# Training throughput and peak memory of troupe next to PyTorch, same model, same machine, same
# invocation (docs/performance.md, "Training, single process (CPU)").
#
# Runs `troupe bench train --json` and scripts/bench/train_pytorch.py alternately, ROUNDS times
# each (troupe, torch, troupe, torch, ...), with the same model, B, T, steps and thread count, and
# prints every run, then a table: tokens/s, seconds per step (wall and CPU, all threads) and peak
# memory (median, min-max) and the ratios troupe / torch taken pair by pair (round i of troupe
# against round i of torch), so a ratio stays meaningful when other tenants change the machine's
# speed during the call.
#
#   scripts/bench/train_vs_pytorch.sh [--model bench-small|gpt2-small] [--batch B] [--seq T]
#       [--steps N] [--warmup N] [--threads N] [--rounds R] [--troupe PATH] [--python PATH]
#       [--torch-args "ARGS"] [--jsonl FILE]
#
# Defaults: bench-small, B=8, T=256, 10 timed steps after 2 warm-up steps, 2 threads, 3 rounds,
# build/apps/troupe, /usr/bin/python3 (Debian's python3-torch). --torch-args are passed to
# train_pytorch.py (e.g. "--aten-capability default"); --jsonl keeps every run's JSON line.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
model=bench-small batch=8 seq=256 steps=10 warmup=2 threads=2 rounds=3
troupe="$root/build/apps/troupe" python=/usr/bin/python3 torch_args="" jsonl=""

usage() { sed -n '2,/^[^#]/{/^#/p}' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) model=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    --seq) seq=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --troupe) troupe=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --torch-args) torch_args=$2; shift 2 ;;
    --jsonl) jsonl=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "train_vs_pytorch.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ ! -x "$troupe" ]]; then
  echo "train_vs_pytorch.sh: no troupe binary at $troupe (--troupe)" >&2
  exit 2
fi

have_torch=1
if ! "$python" -c 'import torch' 2>/dev/null; then
  echo "train_vs_pytorch.sh: $python cannot import torch (install python3-torch): troupe only" >&2
  have_torch=0
fi

common=(--model "$model" --batch "$batch" --seq "$seq" --steps "$steps" --warmup "$warmup"
        --threads "$threads")
runs=$(mktemp)
trap 'rm -f "$runs"' EXIT
echo "# $(date -u +%FT%TZ) $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# model=$model B=$batch T=$seq steps=$steps warmup=$warmup threads=$threads rounds=$rounds"
for ((r = 1; r <= rounds; r++)); do
  # troupe picks its OpenBLAS core itself (tensor/cpu/blas_info.hpp); its threads come from
  # --threads, so no inherited thread variables are needed.
  env -u OPENBLAS_NUM_THREADS -u OMP_NUM_THREADS "$troupe" bench train "${common[@]}" --json |
    tail -n 1 | tee -a "$runs"
  if [[ $have_torch == 1 ]]; then
    # shellcheck disable=SC2086  # torch_args is a list of words on purpose
    "$python" "$here/train_pytorch.py" "${common[@]}" $torch_args | tail -n 1 | tee -a "$runs"
  fi
done
echo "# load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
[[ -n "$jsonl" ]] && cp "$runs" "$jsonl"

"$python" - "$runs" <<'PY'
import json, statistics, sys

runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
by = {impl: [r for r in runs if r["impl"] == impl] for impl in ("troupe", "pytorch")}
mib = 1024.0 * 1024.0

def span(values, fmt):
    if not values:
        return "-"
    v = sorted(values)
    return f"{fmt.format(statistics.median(v))} ({fmt.format(v[0])}-{fmt.format(v[-1])})"

print()
print(f"{'':8} {'tokens/s':>20} {'s/step':>20} {'CPU s/step':>20} {'peak RSS MiB':>18} "
      f"{'host ledger MiB':>16}")
for impl, rs in by.items():
    if not rs:
        continue
    ledger = span([r["host_ledger_peak_bytes"] / mib for r in rs], "{:.0f}") \
        if "host_ledger_peak_bytes" in rs[0] else "-"
    print(f"{impl:8} {span([r['tokens_per_s'] for r in rs], '{:.0f}'):>20} "
          f"{span([r['step_s']['mean'] for r in rs], '{:.3f}'):>20} "
          f"{span([r['cpu_s_per_step'] for r in rs], '{:.3f}'):>20} "
          f"{span([r['peak_rss_bytes'] / mib for r in rs], '{:.0f}'):>18} {ledger:>16}")
pairs = list(zip(by["troupe"], by["pytorch"]))
if pairs:
    tps = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs]
    cpu = [b["cpu_s_per_step"] / a["cpu_s_per_step"] for a, b in pairs]
    rss = [a["peak_rss_bytes"] / b["peak_rss_bytes"] for a, b in pairs]
    print(f"{'ratio':8} {span(tps, '{:.2f}'):>20} {'':>20} {span(cpu, '{:.2f}'):>20} "
          f"{span(rss, '{:.2f}'):>18}")
    print("ratio: troupe / torch round by round, median (min-max); tokens/s and peak RSS as "
          "measured,")
    print("       CPU as tokens per CPU second (torch's CPU s/step over troupe's)")
PY
