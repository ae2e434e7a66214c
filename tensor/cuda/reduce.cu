// CUDA reductions: sum and sum_squares (f64 accumulation, two passes with a fixed order, so the
// result is the same on every run), all_finite, and sum_rows (per-column f32 sums, no atomics).
// f32, bf16 and f16 inputs. sum, sum_squares and all_finite wait for the device (they return a
// host value).
#include "tensor/backend.hpp"
#include "tensor/cuda/check.cuh"

namespace troupe::cuda {
namespace {

using detail::from_f32;
using detail::ptr;
using detail::to_f32;

constexpr int reduce_threads = 256;

// Pass 1: each block writes the sum of its grid-stride share (of x or x^2) to partials[block].
template <class T, bool squares>
__global__ void partial_sums_kernel(const T* x, std::int64_t n, double* partials) {
  __shared__ double shared[32];
  double acc = 0;
  TROUPE_GRID_STRIDE(i, n) {
    double v = to_f32(x[i]);
    acc += squares ? v * v : v;
  }
  acc = detail::block_sum(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// Pass 2: one block of max_partials threads adds the partials.
__global__ void final_sum_kernel(const double* partials, int count, double* out) {
  __shared__ double shared[32];
  double v = static_cast<int>(threadIdx.x) < count ? partials[threadIdx.x] : 0.0;
  v = detail::block_sum(v, shared);
  if (threadIdx.x == 0) *out = v;
}

template <bool squares>
double reduce_sum(const char* name, const tensor& x) {
  double result = 0;
  std::int64_t n = x.numel();
  if (n == 0) return 0;
  detail::dispatch_16_32(name, x, [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto lease = detail::lease_scratch();
    unsigned blocks = std::min<unsigned>(detail::grid_for(n, reduce_threads), detail::max_partials);
    partial_sums_kernel<T, squares><<<blocks, reduce_threads>>>(ptr<T>(x), n, lease.s->partials);
    TROUPE_CUDA_CHECK_LAUNCH();
    final_sum_kernel<<<1, detail::max_partials>>>(lease.s->partials, static_cast<int>(blocks),
                                                  lease.s->value);
    TROUPE_CUDA_CHECK_LAUNCH();
    TROUPE_CUDA_CHECK(cudaMemcpy(&result, lease.s->value, sizeof(double), cudaMemcpyDeviceToHost));
  });
  return result;
}

template <class T>
__global__ void find_nonfinite_kernel(const T* x, std::int64_t n, long long* flag) {
  TROUPE_GRID_STRIDE(i, n) {
    if (!isfinite(to_f32(x[i]))) *flag = 1;  // racing writers all store the same value
  }
}

// out[c] += sum over rows of x[r, c]: a block covers 32 columns; its 8 rows of threads stride over
// the rows and meet in shared memory.
template <class T>
__global__ void sum_rows_kernel(const T* x, T* out, std::int64_t rows, std::int64_t cols) {
  __shared__ float part[8][33];
  std::int64_t c = blockIdx.x * std::int64_t{32} + threadIdx.x;
  float acc = 0;
  if (c < cols)
    for (std::int64_t r = threadIdx.y; r < rows; r += 8) acc += to_f32(x[r * cols + c]);
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0;
    for (int k = 0; k < 8; ++k) total += part[k][threadIdx.x];
    out[c] = from_f32<T>(to_f32(out[c]) + total);
  }
}

}  // namespace

double sum(const tensor& x) {
  return reduce_sum<false>("sum", x);
}
double sum_squares(const tensor& x) {
  return reduce_sum<true>("sum_squares", x);
}

bool all_finite(const tensor& x) {
  long long flag = 0;
  detail::dispatch_16_32("all_finite", x, [&](auto tag) {
    using T = typename decltype(tag)::type;
    std::int64_t n = x.numel();
    if (n == 0) return;
    auto lease = detail::lease_scratch();
    TROUPE_CUDA_CHECK(cudaMemsetAsync(lease.s->words, 0, sizeof(long long)));
    find_nonfinite_kernel<T>
        <<<detail::grid_for(n), detail::block_threads>>>(ptr<T>(x), n, lease.s->words);
    TROUPE_CUDA_CHECK_LAUNCH();
    TROUPE_CUDA_CHECK(cudaMemcpy(&flag, lease.s->words, sizeof(long long), cudaMemcpyDeviceToHost));
  });
  return flag == 0;
}

void sum_rows(const tensor& x, const tensor& out) {
  detail::dispatch_16_32("sum_rows", x, [&](auto tag) {
    using T = typename decltype(tag)::type;
    std::int64_t cols = out.numel();
    if (cols == 0) return;
    std::int64_t rows = x.numel() / cols;
    unsigned blocks = static_cast<unsigned>((cols + 31) / 32);
    sum_rows_kernel<T><<<blocks, dim3(32, 8)>>>(ptr<T>(x), ptr<T>(out), rows, cols);
    TROUPE_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace troupe::cuda
