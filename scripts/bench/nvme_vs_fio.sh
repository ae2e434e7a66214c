#!/usr/bin/env bash
# The NVMe tier's store next to fio, same file size, block size and queue depth, in one invocation
# (docs/performance.md, "NVMe tier I/O"):
#   1. fio --ioengine=io_uring --direct=1 --rw=write, then --rw=read of the same file;
#   2. troupe bench nvme --json: the store's sequential write then read of a file of the same size
#      (pages of one block, the same depth, registered buffers, CRC32C verified on read), called
#      directly (--via store);
#   3. the same through the NVMe actor (--via actor: CAF messages to the actor that owns the store,
#      answered when the I/O completes).
# All run in DIR and remove their files. Prints GB/s (1e9 bytes/s) and the ratio to fio per
# direction (goal >= 0.90). The disk of a shared VM is noisy: compare within one run.
#
# usage: scripts/bench/nvme_vs_fio.sh [--dir DIR] [--size 1G] [--block 1M] [--depth 8]
#          [--troupe PATH] [--nice N]
# Defaults: /var/tmp, 1G, 1M, 8, build/apps/troupe, nice 10. Needs fio (scripts/setup.sh) and
# python3 (to read fio's JSON).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dir=/var/tmp size=1G block=1M depth=8 troupe="$root/build/apps/troupe" nice_level=10
while (($#)); do
  case $1 in
    --dir) dir=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --block) block=$2; shift 2 ;;
    --depth) depth=$2; shift 2 ;;
    --troupe) troupe=$2; shift 2 ;;
    --nice) nice_level=$2; shift 2 ;;
    *) echo "nvme_vs_fio.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
command -v fio >/dev/null || { echo "nvme_vs_fio.sh: fio not found (scripts/setup.sh installs it)" >&2; exit 1; }
[ -x "$troupe" ] || { echo "nvme_vs_fio.sh: $troupe is not an executable (--troupe PATH)" >&2; exit 1; }
mkdir -p "$dir"
file="$dir/troupe_nvme_vs_fio.$$"
trap 'rm -f "$file"' EXIT

fio_bw() {  # $1 = write|read -> GB/s
  nice -n "$nice_level" fio --name="nvme_vs_fio_$1" --filename="$file" --rw="$1" --bs="$block" \
    --iodepth="$depth" --size="$size" --ioengine=io_uring --direct=1 --numjobs=1 \
    --output-format=json |
    python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]['$1']; print(j['bw_bytes']/1e9)"
}

fio_w=$(fio_bw write)
fio_r=$(fio_bw read)
rm -f "$file"
bench() {  # $1 = store|actor -> the bench's JSON line
  nice -n "$nice_level" "$troupe" bench nvme --dir "$dir" --size "$size" --block "$block" \
    --depth "$depth" --via "$1" --json
}
tj=$(bench store)
ta=$(bench actor)
python3 - "$fio_w" "$fio_r" "$tj" "$ta" "$size" "$block" "$depth" <<'PY'
import json, sys
fw, fr, t, a = float(sys.argv[1]), float(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
size, block, depth = sys.argv[5:8]
print(f"file {size}, block {block}, depth {depth}; troupe backend {t['backend']}, "
      f"direct {t['direct']}")
print(f"{'':6} {'fio GB/s':>9} {'store GB/s':>11} {'ratio':>6} {'actor GB/s':>11} {'ratio':>6}")
for name, f, tr, ar in (("write", fw, t["write_gbps"], a["write_gbps"]),
                        ("read", fr, t["read_gbps"], a["read_gbps"])):
    print(f"{name:6} {f:9.2f} {tr:11.2f} {tr / f:6.2f} {ar:11.2f} {ar / f:6.2f}")
PY
