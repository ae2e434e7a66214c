#!/usr/bin/env bash
# Host collectives of troupe next to OpenMPI's, same ops, sizes, timing rules and cores, in the
# same invocation (docs/performance.md, "Collectives on host memory").
#
# Installs openmpi-bin and libopenmpi-dev when mpicc is missing (apt-get; runs as root), builds
# scripts/bench/mpi_allreduce.c with mpicc, then for ROUNDS rounds and for each op in turn runs,
# one right after the other (so that a change in the shared machine's load hits all three alike):
#   OpenMPI, pml ucx, UCX_TLS=posix,sysv,self (shared memory, no CMA: its fastest setup here;
#     pml_ucx_tls/devices "any", without which Debian's OpenMPI refuses UCX on shared memory)
#   OpenMPI, pml ob1, btl vader,self (its default shared-memory path, CMA for large messages)
#   troupe bench collective (ranks forked, connected by UCX, pinned one per CPU)
# all with N ranks bound to cores. Each program reports, per size, the fastest of its --reps
# repetitions (a repetition: the slowest rank's mean time over many iterations); each row here is
# the fastest over rounds, and the MPI column the faster of its two setups for that row (named in
# the mpi column), so the baseline is the strongest MPI measured. ratio = troupe busbw / MPI busbw
# (above 1: troupe is faster).
#
#   scripts/bench/collective_vs_mpi.sh [-n N] [--ops a,b,...] [--min 1K] [--max 256M] [--step 4]
#       [--warmup 5] [--reps 5] [--seconds 0.2] [--rounds 1] [--nice N] [--troupe PATH]
#       [--keep DIR]
#
# Defaults: 2 ranks, all six ops (allreduce, reduce_scatter, all_gather, broadcast, all_to_all,
# all_to_allv with equal splits),
# 1 KiB to 256 MiB in x4 steps, f32, build/apps/troupe. --nice runs every benchmark at that nice
# level (e.g. -5 on a shared machine; the same for both sides). --keep writes the raw CSVs there.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
n=2 ops=allreduce,reduce_scatter,all_gather,broadcast,all_to_all,all_to_allv min=1K max=256M step=4
warmup=5 reps=5 seconds=0.2 rounds=1 nice_level=0 troupe="$root/build/apps/troupe" keep=""

usage() { sed -n '2,/^[^#]/{/^#/p}' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n) n=$2; shift 2 ;;
    --ops) ops=$2; shift 2 ;;
    --min) min=$2; shift 2 ;;
    --max) max=$2; shift 2 ;;
    --step) step=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --nice) nice_level=$2; shift 2 ;;
    --troupe) troupe=$2; shift 2 ;;
    --keep) keep=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "collective_vs_mpi.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ ! -x "$troupe" ]]; then
  echo "collective_vs_mpi.sh: no troupe binary at $troupe (--troupe)" >&2
  exit 2
fi

if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
  echo "collective_vs_mpi.sh: installing openmpi-bin and libopenmpi-dev" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin libopenmpi-dev >/dev/null
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpicc -O2 -o "$work/mpi_allreduce" "$here/mpi_allreduce.c"

cores=$(nproc)
bind=(--bind-to core)
if (( n > cores )); then bind=(--oversubscribe --bind-to core:overload-allowed); fi
args=(--ops "$ops" --min "$min" --max "$max" --step "$step" --warmup "$warmup" --reps "$reps"
      --seconds "$seconds")
mpi=(nice -n "$nice_level" mpirun --allow-run-as-root -np "$n" "${bind[@]}" --map-by core)

echo "collective_vs_mpi: $n ranks on $cores CPUs ($(grep -m1 'model name' /proc/cpuinfo |
  cut -d: -f2- | sed 's/^ //')), f32, nice $nice_level, $rounds round(s)"
echo "  mpi ucx: ${mpi[*]} --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any --mca osc ^ucx -x UCX_TLS=posix,sysv,self mpi_allreduce ${args[*]}"
echo "  mpi ob1: ${mpi[*]} --mca pml ob1 --mca btl vader,self mpi_allreduce ${args[*]}"
echo "  troupe:  nice -n $nice_level $troupe bench collective -n $n --csv ${args[*]}"
# Runs a benchmark into a CSV file; on failure prints the command and its output, and stops.
run_to() {
  local out=$1
  shift
  if ! "$@" >"$out" 2>"$out.err"; then
    echo "collective_vs_mpi.sh: failed: $*" >&2
    tail -n 20 "$out" "$out.err" >&2
    exit 1
  fi
}
IFS=, read -r -a op_list <<<"$ops"
for ((r = 1; r <= rounds; r++)); do
  for op in "${op_list[@]}"; do
    a=(--ops "$op" "${args[@]:2}")
    UCX_TLS=posix,sysv,self run_to "$work/mpi_ucx.$r.$op.csv" "${mpi[@]}" --mca pml ucx \
      --mca pml_ucx_tls any --mca pml_ucx_devices any --mca osc ^ucx -x UCX_TLS \
      "$work/mpi_allreduce" "${a[@]}"
    run_to "$work/mpi_ob1.$r.$op.csv" "${mpi[@]}" --mca pml ob1 --mca btl vader,self \
      "$work/mpi_allreduce" "${a[@]}"
    run_to "$work/troupe.$r.$op.csv" nice -n "$nice_level" "$troupe" bench collective -n "$n" \
      --csv "${a[@]}"
  done
done
if [[ -n "$keep" ]]; then mkdir -p "$keep" && cp "$work"/*.csv "$work"/*.err "$keep"/; fi

# Best time per (source, op, bytes) over rounds, then the side-by-side table.
awk -F, -v n="$n" '
  function bus(op) { return op == "allreduce" ? 2 * (n - 1) / n : op == "broadcast" ? 1 : (n - 1) / n }
  function best(key,   i, b) {
    b = vals[key, 1]
    for (i = 2; i <= cnt[key]; i++) if (vals[key, i] < b) b = vals[key, i]
    return b
  }
  FNR == 1 { n_p = split(FILENAME, p, "/"); src = p[n_p]; sub(/\..*/, "", src); next }
  {
    key = src SUBSEP $1 SUBSEP $2
    vals[key, ++cnt[key]] = $3
    if (!((($1 SUBSEP $2) in seen))) { seen[$1 SUBSEP $2] = 1; order[++rows] = $1 SUBSEP $2 }
  }
  END {
    printf "%-15s %9s | %11s %9s | %11s %9s %-7s | %6s\n", "op", "size", "troupe_us", "busbw", "mpi_us", "busbw", "mpi", "ratio"
    for (i = 1; i <= rows; i++) {
      split(order[i], f, SUBSEP); op = f[1]; b = f[2]
      kt = "troupe" SUBSEP op SUBSEP b; ku = "mpi_ucx" SUBSEP op SUBSEP b; ko = "mpi_ob1" SUBSEP op SUBSEP b
      if (!(kt in cnt)) continue
      tt = best(kt); who = ""; tm = 0
      if (ku in cnt) { tm = best(ku); who = "ucx" }
      if (ko in cnt) { to = best(ko); if (who == "" || to < tm) { tm = to; who = "ob1" } }
      size = b >= 1048576 ? sprintf("%dMiB", b / 1048576) : b >= 1024 ? sprintf("%dKiB", b / 1024) : b "B"
      bt = b / (tt * 1e-6) / 1e9 * bus(op)
      if (who == "") { printf "%-15s %9s | %11.2f %9.3f | %11s %9s %-7s | %6s\n", op, size, tt, bt, "-", "-", "-", "-"; continue }
      bm = b / (tm * 1e-6) / 1e9 * bus(op)
      printf "%-15s %9s | %11.2f %9.3f | %11.2f %9.3f %-7s | %6.2f\n", op, size, tt, bt, tm, bm, who, bt / bm
    }
    print "(busbw in GB/s of 1e9 B: algbw x 2(n-1)/n allreduce, (n-1)/n reduce_scatter, all_gather, all_to_all(v), 1 broadcast)"
  }' $(for op in "${op_list[@]}"; do echo "$work"/troupe.*."$op".csv; done) \
    "$work"/mpi_ucx.*.csv "$work"/mpi_ob1.*.csv
