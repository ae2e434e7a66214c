#!/usr/bin/env bash
# The GPU check: one command on a lent H100/H200 machine (CUDA toolkit, CMake, ninja, PyTorch, no
# package registry) that builds troupe for the GPU's architecture against the Debian packages
# carried along, runs every [gpu] test, then the GPU benchmarks, and writes all of it to one
# results file (docs/gpu.md). It also runs on a machine without a GPU, where the GPU tests report
# themselves skipped and the benchmarks are skipped.
#
#   bash scripts/gpu/check.sh [--debs DIR] [--build DIR] [--budget SECONDS] [--jobs N]
#                             [--no-bench] [--until STEP] [--system-deps]
#
#   --debs DIR      the .deb files of scripts/gpu/fetch_deps.sh (default carry/gpu-debs)
#   --build DIR     build folder (default build-gpu); the packages unpack into DIR/deps
#   --budget S      wall-clock budget of the whole check (default 450): each step gets what is
#                   left, and a step that would start with too little is skipped and reported
#   --jobs N        build jobs (default: all CPUs)
#   --no-bench      tests only
#   --until STEP    stop after STEP: unpack, configure, build or tests
#   --system-deps   find the dependencies where CMake finds them by default (no .deb files)
#
# Results: $OUT/gpu-check.txt, or gpu-results/gpu-check.txt where OUT is unset. Exit status 0 when
# every step that ran passed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 1

debs=carry/gpu-debs build=build-gpu budget=450 jobs=$(nproc) bench=1 system_deps=0 until=all
usage() { sed -n '2,/^set -uo/{/^#/p}' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --debs) debs=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --no-bench) bench=0; shift ;;
    --until) until=$2; shift 2 ;;
    --system-deps) system_deps=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "check.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
done
case $until in
  unpack|configure|build|tests|all) ;;
  *) echo "check.sh: --until takes unpack, configure, build or tests, not $until" >&2; exit 2 ;;
esac

out=${OUT:-$root/gpu-results}
mkdir -p "$out" "$build"
results=$out/gpu-check.txt
: >"$results"
prefix=$(cd "$build" && pwd)/deps
start=$(date +%s)
deadline=$((start + budget))
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
summary=()
failures=0

say() { echo "$*" | tee -a "$results"; }
left() { echo $((deadline - $(date +%s))); }

# step NAME CAP FUNCTION: runs FUNCTION (in a child bash, so that `timeout` can stop it) for at most
# CAP seconds or what is left of the budget, its output into the results file under a header. On
# failure prints the tail of its output. Returns FUNCTION's status (124: out of time; 125: skipped).
step() {
  local name=$1 cap=$2 fn=$3 l rc status t0 dt
  l=$(left)
  ((cap > l)) && cap=$l
  if ((cap < 10)); then
    say "== $name: skipped, ${l}s of the ${budget}s budget left"
    summary+=("$(printf '%-12s skipped (budget spent)' "$name")")
    failures=$((failures + 1))
    return 125
  fi
  echo "== $name ($(date +%T), at most ${cap}s)" >>"$results"
  printf '%-12s ' "$name"
  t0=$(date +%s)
  timeout --kill-after=10 "$cap" bash -c "set -uo pipefail; $(declare -f); $fn" \
    >"$logs/$name.log" 2>&1
  rc=$?
  dt=$(($(date +%s) - t0))
  cat "$logs/$name.log" >>"$results"
  case $rc in
    0) status=ok ;;
    124|137) status="TIMED OUT after ${cap}s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  echo "$status, ${dt}s"
  echo "-- $name: $status, ${dt}s" >>"$results"
  summary+=("$(printf '%-12s %s, %ss' "$name" "$status" "$dt")")
  if ((rc != 0)); then
    failures=$((failures + 1))
    echo "   last lines of $name:"
    tail -n 30 "$logs/$name.log" | sed 's/^/   | /'
  fi
  return $rc
}

# ---- the machine ---------------------------------------------------------------------------------
nvcc=$(command -v nvcc || true)
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
have_gpu=0 arch=90 gpu_name=none
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  have_gpu=1
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
  [[ $cap =~ ^[0-9]+$ ]] && arch=$cap
  gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
fi
python=$(command -v python3 || true)
{
  commit=${TROUPE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  git rev-parse HEAD >/dev/null 2>&1 && ! git diff --quiet HEAD 2>/dev/null &&
    commit="$commit (with local changes)"
  echo "troupe GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $commit"
  echo "machine: $(uname -srm), $(nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
  echo "os: $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME"); $(ldd --version 2>&1 | head -1)"
  echo "c++: $(c++ --version 2>&1 | head -1)"
  echo "cmake: $(cmake --version 2>&1 | head -1); ninja $(ninja --version 2>&1); ccache: $(command -v ccache || echo none)"
  echo "nvcc: ${nvcc:-none} $([ -n "$nvcc" ] && "$nvcc" --version | tail -1)"
  echo "gpu: $gpu_name, CMAKE_CUDA_ARCHITECTURES=$arch"
  [ "$have_gpu" = 1 ] && nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.max.sm --format=csv
  echo "python3: ${python:-none} $([ -n "$python" ] && "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tail -1)"
  echo "budget: ${budget}s; build jobs: $jobs; debs: $debs"
} >>"$results"
cat "$results"
echo

# ---- steps (each runs in a child bash: it sees only exported variables) ---------------------------
lib=$prefix/usr/lib/x86_64-linux-gnu
export root debs build prefix lib nvcc arch jobs system_deps
base_ld=${LD_LIBRARY_PATH:-}
export base_ld

# Unpacks every .deb into $prefix (dpkg -x, or Python's ar and tar readers where dpkg is absent)
# and points the packages' pkg-config and CMake files, written for /usr, at $prefix/usr.
unpack() {
  shopt -s nullglob
  local files=("$debs"/*.deb) f stamp
  if ((${#files[@]} == 0)); then
    echo "no .deb files in $debs: run scripts/gpu/fetch_deps.sh before the device call and carry $debs"
    return 1
  fi
  stamp=$(cat "$debs/MANIFEST" 2>/dev/null; ls -l "${files[@]}")
  if [ -f "$prefix/.unpacked" ] && [ "$(cat "$prefix/.unpacked")" = "$stamp" ]; then
    echo "already unpacked into $prefix"
  else
    rm -rf "$prefix" && mkdir -p "$prefix" || return 1
    for f in "${files[@]}"; do
      if command -v dpkg >/dev/null && [ "${TROUPE_GPU_UNPACK:-}" != python ]; then
        dpkg -x "$f" "$prefix" || { echo "dpkg -x $f failed"; return 1; }
      else
        python3 - "$f" "$prefix" <<'PY' || { echo "unpacking $f failed"; return 1; }
import io, sys, tarfile
deb, dest = sys.argv[1], sys.argv[2]
with open(deb, "rb") as fh:
    data = fh.read()
assert data[:8] == b"!<arch>\n", f"{deb}: not an ar archive"
pos = 8
while pos + 60 <= len(data):
    name = data[pos:pos + 16].decode().strip().rstrip("/")
    size = int(data[pos + 48:pos + 58].decode().strip())
    body = data[pos + 60:pos + 60 + size]
    if name.startswith("data.tar"):
        with tarfile.open(fileobj=io.BytesIO(body)) as tar:  # .xz, .gz, .bz2 (not .zst)
            tar.extractall(dest, filter="tar") if hasattr(tarfile, "data_filter") else tar.extractall(dest)
        break
    pos += 60 + size + (size & 1)
else:
    sys.exit(f"{deb}: no data.tar member")
PY
      fi
    done
    # Debian writes absolute /usr paths into these; dpkg -x does not run maintainer scripts.
    find "$prefix/usr" \( -name '*.pc' -o -name '*.cmake' \) -type f -print0 |
      xargs -0 grep -lZ '/usr' | xargs -0 -r sed -i -E \
        "s#(^|[=\" ]|-I|-L)/usr(/|\"|\$| )#\1$prefix/usr\2#g"
    # The compiler searches <include>/x86_64-linux-gnu only under /usr: copy what packages put
    # there (openssl/configuration.h) beside the rest of the prefix's headers.
    if [ -d "$prefix/usr/include/x86_64-linux-gnu" ]; then
      cp -an "$prefix/usr/include/x86_64-linux-gnu/." "$prefix/usr/include/" || true  # -n: what is there wins
    fi
    echo "$stamp" >"$prefix/.unpacked"
    echo "unpacked ${#files[@]} packages into $prefix ($(du -sh "$prefix" | cut -f1))"
  fi
  # Every shared library of the prefix must load from the prefix or the machine's base libraries.
  local missing
  missing=$(find "$lib" -name '*.so*' -type f -print0 |
    LD_LIBRARY_PATH=$lib:$lib/openblas-pthread:$base_ld xargs -0 ldd 2>&1 |
    grep -E 'not found|version .* not found' | sort -u)
  if [ -n "$missing" ]; then
    echo "libraries the prefix lacks:"
    echo "$missing"
    return 1
  fi
  echo "every shared library of the prefix resolves"
}

configure() {
  local args=(-S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
              -DTROUPE_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch"
              -DCMAKE_POLICY_VERSION_MINIMUM=3.5)
  [ -n "$nvcc" ] && args+=(-DCMAKE_CUDA_COMPILER="$nvcc")
  if command -v ccache >/dev/null; then
    args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  if [ "$system_deps" = 0 ]; then
    # Only the prefix (and the CUDA toolkit, found from nvcc): never the machine's /usr.
    args+=(-DCMAKE_PREFIX_PATH="$prefix/usr" -DCMAKE_FIND_USE_CMAKE_SYSTEM_PATH=OFF
           -DOpenBLAS_DIR="$lib/openblas-pthread/cmake/openblas"
           -DPKG_CONFIG_EXECUTABLE="$prefix/usr/bin/pkgconf")
    export PKG_CONFIG_LIBDIR=$lib/pkgconfig:$prefix/usr/share/pkgconfig PKG_CONFIG_PATH=
    export LD_LIBRARY_PATH=$lib:$lib/openblas-pthread:$base_ld
  fi
  # NCCL: the toolkit's, else the one PyTorch's wheels bring (nvidia-nccl-cu13: libnccl.so.2 only).
  local cuda_root nccl_dir
  cuda_root=$(dirname "$(dirname "$(readlink -f "${nvcc:-/nonexistent}")")")
  if [ -n "$nvcc" ] && ! ls "$cuda_root"/lib*/libnccl.so* "$cuda_root"/targets/*/lib/libnccl.so* \
       >/dev/null 2>&1; then
    nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)
    if [ -n "$nccl_dir" ] && [ -f "$nccl_dir/include/nccl.h" ]; then
      echo "NCCL from PyTorch's wheel: $nccl_dir"
      args+=(-DNCCL_INCLUDE_DIR="$nccl_dir/include"
             -DNCCL_LIBRARY="$(ls "$nccl_dir"/lib/libnccl.so* | head -1)")
    else
      echo "no NCCL found: the NCCL tests will not be built"
    fi
  fi
  echo "cmake ${args[*]}"
  cmake "${args[@]}" || return 1
  grep -E 'TROUPE_HAVE_CUDA|CMAKE_CUDA_ARCHITECTURES:|NCCL_LIBRARY:|CAF_CORE_LIBRARY:' \
    "$build/CMakeCache.txt"
}

# The test binaries that hold a test tagged [gpu] (module folder -> troupe_<module>_tests), and the
# troupe command.
gpu_targets() {
  cd "$root" && grep -rlE --include='*.test.cpp' '"(\[[a-z0-9_.-]+\])*\[gpu\]' \
    memory tensor collective scheduler models actors tests |
    awk -F/ '{print ($1 == "tests") ? "troupe_" $2 "_tests" : "troupe_" $1 "_tests"}' | sort -u
  echo troupe
}

build_step() {
  [ "$system_deps" = 0 ] && export LD_LIBRARY_PATH=$lib:$lib/openblas-pthread:$base_ld
  local targets
  targets=$(gpu_targets | tr '\n' ' ')
  echo "targets: $targets"
  # shellcheck disable=SC2086
  cmake --build "$build" -j "$jobs" --target $targets || return 1
  if [ "$system_deps" = 0 ]; then
    # A header the prefix has, taken from the machine's /usr/include instead, mixes two versions.
    local shadowed
    shadowed=$(ninja -C "$build" -t deps | sed -nE 's#^ +/usr/include/(.*)#\1#p' | sort -u |
      while read -r h; do [ -e "$prefix/usr/include/$h" ] && echo "  /usr/include/$h"; done)
    if [ -n "$shadowed" ]; then
      echo "the build read these from /usr/include, not from $prefix/usr/include:"
      echo "$shadowed"
      return 1
    fi
    echo "no header the prefix has was read from /usr/include"
  fi
  ldd "$build/apps/troupe" | grep -E 'caf|ucp|uring|openblas|ssl|crypto|sentencepiece|fmt|toml|cudart|cublas|nccl'
}

gpu_tests() {
  [ "$system_deps" = 0 ] && export LD_LIBRARY_PATH=$lib:$lib/openblas-pthread:$base_ld
  # CTest includes every test binary's list; the ones this check did not build list nothing.
  grep -rhoE 'include\("[^"]*_ctest\.cmake"\)' "$build" --include=CTestTestfile.cmake |
    sed -E 's/include\("(.*)"\)/\1/' | while read -r f; do [ -f "$f" ] || : >"$f"; done
  # [gpu], and [amx]: the CPU AMX path, opt-in until it passes on this machine's Xeon.
  ctest --test-dir "$build" -L '^(gpu|amx)$' -V --timeout "${TROUPE_GPU_TEST_TIMEOUT:-300}"
}

# troupe on the GPU: the shapes of the PyTorch runs below, f32 and bf16 (f32 master weights).
bench_troupe() {
  [ "$system_deps" = 0 ] && export LD_LIBRARY_PATH=$lib:$lib/openblas-pthread:$base_ld
  local t=$build/apps/troupe rc=0
  if ! "$t" bench train --help 2>&1 | grep -q -- '--device'; then
    echo "troupe has no GPU benchmark yet: \`troupe bench train\` runs on the CPU only (no --device)."
    return 0
  fi
  "$t" bench train --device cuda --model bench-small --batch 8 --seq 256 --json || rc=1
  "$t" bench train --device cuda --model gpt2-small --batch 4 --seq 256 --json || rc=1
  "$t" bench train --device cuda --precision bf16 --model bench-small --batch 8 --seq 256 --json ||
    rc=1
  "$t" bench train --device cuda --precision bf16 --model gpt2-small --batch 16 --seq 1024 \
    --steps 5 --json || rc=1
  # GPT-2 small's attention at T 1024 alone: the tensor-core kernel next to the CUDA-core one.
  if "$t" bench --help 2>&1 | grep -qE '^ +attention '; then
    "$t" bench attention --device cuda --precision bf16 --batch 16 --heads 12 --seq 1024 \
      --head-dim 64 --steps 10 --warmup 2 --json || rc=1
  fi
  return $rc
}

# PyTorch on the same GPU: the two ceilings, the same f32 step as troupe's (manual attention,
# foreach AdamW, eager), and its strongest configuration (--fast: SDPA, fused AdamW,
# torch.compile) in f32 and in bf16 autocast. Each run is independent: one failing (a compiler
# missing for torch.compile) does not hide the others.
bench_torch() {
  if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "no CUDA device visible to PyTorch: PyTorch GPU baselines skipped"
    return 0
  fi
  local rc=0 py=$root/scripts/bench/train_pytorch.py
  python3 "$root/scripts/gpu/ceilings.py" || rc=1
  python3 "$py" --device cuda --model bench-small --batch 8 --seq 256 --steps 20 --warmup 3 || rc=1
  python3 "$py" --device cuda --model gpt2-small --batch 4 --seq 256 --steps 20 --warmup 3 || rc=1
  python3 "$py" --device cuda --fast --model gpt2-small --batch 4 --seq 256 --steps 20 \
    --warmup 3 || rc=1
  python3 "$py" --device cuda --fast --precision bf16 --model bench-small --batch 8 --seq 256 \
    --steps 20 --warmup 3 || rc=1
  python3 "$py" --device cuda --fast --precision bf16 --model gpt2-small --batch 16 --seq 1024 \
    --steps 10 --warmup 3 || rc=1
  return $rc
}

# ---- run -----------------------------------------------------------------------------------------
ok=1
if [ "$system_deps" = 0 ]; then
  step unpack 120 unpack || ok=0
fi
[ "$until" = unpack ] && ok=0 bench=0
((ok)) && { step configure 120 configure || ok=0; }
[ "$until" = configure ] && ok=0 bench=0
((ok)) && { step build "$budget" build_step || ok=0; }
[ "$until" = build ] && ok=0 bench=0
((ok)) && step gpu-tests 300 gpu_tests
[ "$until" = tests ] && bench=0
if ((ok)) && ((bench)); then
  step bench-troupe 170 bench_troupe
  step bench-torch 240 bench_torch
fi

# ---- summary -------------------------------------------------------------------------------------
{
  echo
  echo "== summary ($gpu_name, sm_$arch, $(($(date +%s) - start))s of ${budget}s)"
  printf '  %s\n' "${summary[@]}"
  log=$logs/gpu-tests.log
  if [ -f "$log" ]; then
    # ctest -V progress lines: " 3/34 Test  #84: NAME .....   Passed    0.1 sec".
    awk '/^ *[0-9]+\/[0-9]+ Test +#[0-9]+:/ {
           if ($0 ~ /\*\*\*Skipped/) s++; else if ($0 ~ / Passed /) p++; else f++; n++ }
         END { printf "  gpu tests: %d run: %d passed, %d failed, %d skipped\n", n, p, f, s }' "$log"
    awk '/^ *[0-9]+\/[0-9]+ Test +#[0-9]+:/ && !/ Passed / && !/\*\*\*Skipped/' "$log" |
      sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: /    FAILED: /; s/ \.{3,}\**/: /'
    if [ "$have_gpu" = 1 ]; then
      awk '/^ *[0-9]+\/[0-9]+ Test +#[0-9]+:/ && /\*\*\*Skipped/' "$log" |
        sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: /    skipped on this GPU machine: /; s/ \.{3,}.*//'
    fi
    grep -ho 'troupe-skip: .*' "$log" | sort | uniq -c | sed 's/^ */    /; s/ troupe-skip:/ x troupe-skip:/'
  fi
  for log in "$logs/bench-troupe.log" "$logs/bench-torch.log"; do
    [ -f "$log" ] || continue
    grep -E '^\{' "$log" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    if "tokens_per_s" in r:
        who = "%s %s %s%s %s B%s T%s" % (r.get("impl", "?"), r.get("device", "cpu"),
                                         r.get("precision", "f32"),
                                         " fast" if r.get("fast") else "", r["model"],
                                         r["batch"], r["seq"])
        if r.get("device_ledger_peak_bytes") or r.get("peak_device_bytes"):
            who += " (peak device %.0f MiB)" % ((r.get("device_ledger_peak_bytes") or
                                                 r.get("peak_device_bytes")) / 2**20)
        print("  %s: %.0f tokens/s, %.1f ms/step median"
              % (who, r["tokens_per_s"], r["step_s"]["median"] * 1e3))
    elif r.get("bench") == "attention":
        print("  attention %s %s %s B%s T%s Hq%s D%s: fwd+bwd %.2f ms, %.0f tokens/s, %.1f TFLOP/s"
              " (fwd %.1f)" % (r["kernel"], r["device"], r["precision"], r["batch"], r["seq"],
                               r["heads"], r["head_dim"], r["forward_backward_s"] * 1e3,
                               r["attention_tokens_per_s"], r["forward_backward_tflops"],
                               r["forward_tflops"]))
    elif "ceiling" in r:
        print("  %s: %.1f %s" % (r["ceiling"], r["value"], r["unit"]))
' 2>/dev/null
    grep -q 'no GPU benchmark yet' "$log" && echo "  troupe: no GPU benchmark yet (bench train/kernels are CPU only)"
  done
  echo "  results: $results"
} | tee -a "$results"
((failures == 0))
