#!/usr/bin/env bash
# The numeric suites (the tensor, collective and models tests, without the gpu / multirank / slow
# labels) again, under other summation orders than scripts/test.sh's: OpenBLAS's Haswell (AVX2)
# GEMM kernels as well as the AVX-512 ones troupe selects on this CPU, each with 1 and 2 threads.
# A tolerance fitted to one machine's kernels then fails here, not on a user's CPU (issue 21).
# Reuses the build of scripts/test.sh (or builds it); extra arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${TROUPE_BUILD_DIR:-build}
[ -x "$dir/tensor/troupe_tensor_tests" ] || bash scripts/build.sh
passes=("Haswell 1" "Haswell 2" "default 1")
for pass in "${passes[@]}"; do
  read -r core threads <<<"$pass"
  if [ "$core" = default ]; then
    # troupe's own choice: the AVX-512 core where the CPU has AVX-512 (as in scripts/test.sh).
    expect=$(grep -q avx512f /proc/cpuinfo && echo avx512 || echo Haswell)
    vars=(TROUPE_NUM_THREADS="$threads" TROUPE_EXPECT_BLAS_CORE="$expect")
  else
    vars=(TROUPE_KEEP_OPENBLAS_CORETYPE=1 OPENBLAS_CORETYPE="$core" TROUPE_NUM_THREADS="$threads"
          TROUPE_EXPECT_BLAS_CORE="$core")
  fi
  echo "== numerics: ${vars[*]}"
  env "${vars[@]}" "$dir/tensor/troupe_tensor_tests" "[.blas_core]"
  env "${vars[@]}" ctest --test-dir "$dir" --output-on-failure -j "$(nproc)" \
    -R '^(tensor|collective|models):' -LE 'gpu|multirank|slow' "$@"
done
