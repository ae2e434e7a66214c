// Shared pieces of the CPU kernels (internal to tensor/cpu): dtype dispatch, work splitting and
// reductions written so that GCC vectorizes them without -ffast-math.
//
// GCC does not reorder floating-point sums on its own, so a plain `s += x[i]` loop stays scalar.
// The reductions here keep W independent lanes (two AVX2 vectors) that the compiler maps onto
// vector registers, and add the lanes at the end. `#pragma GCC unroll 1` on the lane loop stops
// GCC from unrolling it into scalars before the vectorizer sees it. Whole-tensor reductions split
// the range into chunks fixed by the size alone and add the partial results in chunk order, so a
// result does not depend on the number of threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "memory/error.hpp"
#include "tensor/dtype.hpp"
#include "tensor/parallel.hpp"

namespace troupe::cpu {

// Elements per parallel chunk for cheap elementwise loops, and for loops that evaluate an exp.
inline constexpr std::int64_t elem_grain = 32768;
inline constexpr std::int64_t exp_grain = 8192;

// Rows per chunk so that a chunk holds about `grain` elements (at least one row).
inline std::int64_t row_grain(std::int64_t cols, std::int64_t grain = elem_grain) {
  return std::max<std::int64_t>(1, grain / std::max<std::int64_t>(cols, 1));
}

// Calls f(T{}) with T = float for f32 and double for f64; any other dtype is an error that names
// the op ("cpu gelu: dtype bf16 not supported").
template <class F>
decltype(auto) dispatch_float(const char* op, dtype t, F&& f) {
  switch (t) {
    case dtype::f32:
      return f(float{});
    case dtype::f64:
      return f(double{});
    default:
      break;
  }
  TROUPE_FAIL("cpu ", op, ": dtype ", dtype_name(t), " not supported (f32 and f64 are)");
}

// Calls f(S{}) with S the storage type of any floating dtype: float, double, bf16_t or f16_t. The
// 16-bit types compute in f32 (tensor/cpu/half.hpp).
template <class F>
decltype(auto) dispatch_floating(const char* op, dtype t, F&& f) {
  switch (t) {
    case dtype::f32:
      return f(float{});
    case dtype::f64:
      return f(double{});
    case dtype::bf16:
      return f(bf16_t{});
    case dtype::f16:
      return f(f16_t{});
    default:
      break;
  }
  TROUPE_FAIL("cpu ", op, ": dtype ", dtype_name(t), " not supported (f32, f64, bf16 and f16 are)");
}

// Lanes per reduction: 64 bytes of accumulators, two AVX2 registers.
template <class Acc>
inline constexpr int lanes = static_cast<int>(64 / sizeof(Acc));

// Sum of f(i) over [lo, hi), accumulated in lanes of type Acc and returned as double. With
// Acc = float each lane adds at most 32 terms before its total moves into a double, which keeps
// the error of long sums near that of a double sum while the inner loop runs at float speed.
template <class Acc, class F>
inline double lane_sum(std::int64_t lo, std::int64_t hi, F&& f) {
  constexpr int w = lanes<Acc>;
  double total = 0;
  std::int64_t i = lo;
  while (hi - i >= w) {
    // Narrow accumulators are flushed to double every 32 vectors; double ones run to the end.
    std::int64_t end = sizeof(Acc) < sizeof(double) ? std::min(hi, i + 32 * w) : hi;
    Acc acc[w] = {};
    for (; i + w <= end; i += w)
#pragma GCC unroll 1
      for (int j = 0; j < w; ++j) acc[j] += f(i + j);
    for (int j = 0; j < w; ++j) total += static_cast<double>(acc[j]);
  }
  for (; i < hi; ++i) total += static_cast<double>(f(i));
  return total;
}

// Largest of x[0, n) (-inf for n == 0); NaN elements are skipped.
template <class T>
inline T lane_max(const T* x, std::int64_t n) {
  constexpr int w = lanes<T>;
  T acc[w];
  for (int j = 0; j < w; ++j) acc[j] = -std::numeric_limits<T>::infinity();
  std::int64_t i = 0;
  for (; i + w <= n; i += w)
#pragma GCC unroll 1
    for (int j = 0; j < w; ++j) acc[j] = x[i + j] > acc[j] ? x[i + j] : acc[j];
  T m = -std::numeric_limits<T>::infinity();
  for (int j = 0; j < w; ++j) m = acc[j] > m ? acc[j] : m;
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// Runs f(lo, hi) -> double on fixed chunks of [0, n) in parallel and returns the sum of the
// results added in chunk order. The chunking depends on n and grain only, never on the thread
// count, so the result is reproducible.
inline constexpr int max_reduce_chunks = 256;
template <class F>
inline double reduce_chunks(std::int64_t n, std::int64_t grain, F&& f) {
  std::int64_t chunks = std::clamp<std::int64_t>((n + grain - 1) / grain, 1, max_reduce_chunks);
  double part[max_reduce_chunks];
  parallel::parallel_for(0, chunks, 1, [&](std::int64_t a, std::int64_t b) {
    for (std::int64_t c = a; c < b; ++c) part[c] = f(n * c / chunks, n * (c + 1) / chunks);
  });
  double total = 0;
  for (std::int64_t c = 0; c < chunks; ++c) total += part[c];
  return total;
}

// Column tiles for reductions over rows (sum_rows, parameter gradients, embedding_backward): each
// tile of columns belongs to one thread, which walks all rows, so the += needs no atomics. A
// column's sum runs over the rows in order whatever the tiling, so results do not depend on the
// thread count; tiles are as wide as the thread count allows (up to max_col_tile) so that each
// row contributes a long contiguous run.
inline constexpr std::int64_t max_col_tile = 256;
template <class F>
inline void for_column_tiles(std::int64_t rows, std::int64_t cols, F&& f) {
  const std::int64_t threads = parallel::num_threads();
  const std::int64_t per_thread = (cols + threads - 1) / threads;
  const std::int64_t tile = std::clamp<std::int64_t>((per_thread + 15) / 16 * 16, 16, max_col_tile);
  const std::int64_t tiles = (cols + tile - 1) / tile;
  const std::int64_t grain =
      std::max<std::int64_t>(1, elem_grain / std::max<std::int64_t>(rows * tile, 1));
  parallel::parallel_for(0, tiles, grain, [&](std::int64_t a, std::int64_t b) {
    for (std::int64_t t = a; t < b; ++t) f(t * tile, std::min(cols, (t + 1) * tile));
  });
}

}  // namespace troupe::cpu
