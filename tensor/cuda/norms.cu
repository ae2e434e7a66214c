// CUDA softmax, layernorm and rmsnorm over the last dimension, for f32, bf16 and f16 data (loaded
// to f32, reduced in f32, each output rounded once). The saved statistics (layernorm mean and
// rstd, rmsnorm rstd) are stored in the data's dtype or in f32, whichever the caller passes; the
// forward output always uses the unrounded f32 statistics.
//
// One block per row with warp-shuffle block reductions; the weight and bias gradients of the
// backwards are column sums done by a second kernel (no atomics, same result on every run, one
// rounding per element onto the gradient already there), which runs first so that dx may alias
// dy or x.
#include "tensor/backend.hpp"
#include "tensor/cuda/check.cuh"

namespace troupe::cuda {
namespace {

using detail::block_max;
using detail::block_sum;
using detail::from_f32;
using detail::ptr;
using detail::to_f32;

constexpr int row_threads = 256;
constexpr std::int64_t max_row_blocks = 1 << 20;

std::int64_t rows_of(const tensor& x) {
  return x.dim() == 0 ? 1 : x.numel() / std::max<std::int64_t>(x.size(-1), 1);
}
unsigned row_grid(std::int64_t rows) {
  return static_cast<unsigned>(std::min(rows, max_row_blocks));
}

// Blocks stride over the rows; every thread of a block runs the same iterations, so the block
// reductions inside are reached by all of them.
#define TROUPE_FOR_ROWS(r, rows) for (std::int64_t r = blockIdx.x; r < (rows); r += gridDim.x)

template <class T>
__global__ void softmax_kernel(const T* x, T* y, std::int64_t rows, std::int64_t cols) {
  __shared__ float shared[32];
  TROUPE_FOR_ROWS(r, rows) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    float m = -INFINITY;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, to_f32(xr[c]));
    m = block_max(m, shared);
    float s = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += expf(to_f32(xr[c]) - m);
    float inv = 1.0f / block_sum(s, shared);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      yr[c] = from_f32<T>(expf(to_f32(xr[c]) - m) * inv);
  }
}

template <class T>
__global__ void softmax_backward_kernel(const T* y, const T* dy, T* dx, std::int64_t rows,
                                        std::int64_t cols) {
  __shared__ float shared[32];
  TROUPE_FOR_ROWS(r, rows) {
    const T* yr = y + r * cols;
    const T* dyr = dy + r * cols;
    T* dxr = dx + r * cols;
    float s = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      s += to_f32(yr[c]) * to_f32(dyr[c]);
    s = block_sum(s, shared);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      dxr[c] = from_f32<T>(to_f32(yr[c]) * (to_f32(dyr[c]) - s));
  }
}

// T: data, weights and gradients; S: saved statistics (T or float). b may be null.
template <class T, class S>
__global__ void layernorm_kernel(const T* x, const T* w, const T* b, T* y, S* mean, S* rstd,
                                 std::int64_t rows, std::int64_t cols, float eps) {
  __shared__ float shared[32];
  const float inv_cols = 1.0f / static_cast<float>(cols);
  TROUPE_FOR_ROWS(r, rows) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    float s = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += to_f32(xr[c]);
    float mu = block_sum(s, shared) * inv_cols;
    float v = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float d = to_f32(xr[c]) - mu;
      v += d * d;
    }
    float rs = 1.0f / sqrtf(block_sum(v, shared) * inv_cols + eps);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      yr[c] = from_f32<T>((to_f32(xr[c]) - mu) * rs * to_f32(w[c]) +
                          (b != nullptr ? to_f32(b[c]) : 0.0f));
    if (threadIdx.x == 0) {
      mean[r] = from_f32<S>(mu);
      rstd[r] = from_f32<S>(rs);
    }
  }
}

template <class T, class S>
__global__ void layernorm_backward_kernel(const T* dy, const T* x, const T* w, const S* mean,
                                          const S* rstd, T* dx, std::int64_t rows,
                                          std::int64_t cols) {
  __shared__ float shared[32];
  const float inv_cols = 1.0f / static_cast<float>(cols);
  TROUPE_FOR_ROWS(r, rows) {
    const T* xr = x + r * cols;
    const T* dyr = dy + r * cols;
    T* dxr = dx + r * cols;
    const float mu = to_f32(mean[r]), rs = to_f32(rstd[r]);
    float sg = 0, sgx = 0;  // sums of g = dy * w and of g * xhat
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float g = to_f32(dyr[c]) * to_f32(w[c]);
      sg += g;
      sgx += g * (to_f32(xr[c]) - mu) * rs;
    }
    sg = block_sum(sg, shared) * inv_cols;
    sgx = block_sum(sgx, shared) * inv_cols;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float g = to_f32(dyr[c]) * to_f32(w[c]);
      float xhat = (to_f32(xr[c]) - mu) * rs;
      dxr[c] = from_f32<T>(rs * (g - sg - xhat * sgx));
    }
  }
}

template <class T, class S>
__global__ void rmsnorm_kernel(const T* x, const T* w, T* y, S* rstd, std::int64_t rows,
                               std::int64_t cols, float eps) {
  __shared__ float shared[32];
  const float inv_cols = 1.0f / static_cast<float>(cols);
  TROUPE_FOR_ROWS(r, rows) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    float s = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float v = to_f32(xr[c]);
      s += v * v;
    }
    float rs = 1.0f / sqrtf(block_sum(s, shared) * inv_cols + eps);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      yr[c] = from_f32<T>(to_f32(xr[c]) * rs * to_f32(w[c]));
    if (threadIdx.x == 0) rstd[r] = from_f32<S>(rs);
  }
}

// dx = rstd * (g - x * rstd^2 * mean(g * x)) with g = dy * w.
template <class T, class S>
__global__ void rmsnorm_backward_kernel(const T* dy, const T* x, const T* w, const S* rstd, T* dx,
                                        std::int64_t rows, std::int64_t cols) {
  __shared__ float shared[32];
  const float inv_cols = 1.0f / static_cast<float>(cols);
  TROUPE_FOR_ROWS(r, rows) {
    const T* xr = x + r * cols;
    const T* dyr = dy + r * cols;
    T* dxr = dx + r * cols;
    const float rs = to_f32(rstd[r]);
    float s = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      s += to_f32(dyr[c]) * to_f32(w[c]) * to_f32(xr[c]);
    s = block_sum(s, shared) * inv_cols;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      dxr[c] = from_f32<T>(rs * (to_f32(dyr[c]) * to_f32(w[c]) - to_f32(xr[c]) * rs * rs * s));
  }
}

// dw[c] += sum_r dy[r,c] * xhat[r,c] and, if db is given, db[c] += sum_r dy[r,c], where xhat is
// (x - mean[r]) * rstd[r] (mean null: rmsnorm, xhat = x * rstd[r]). A block covers 32 columns.
// The sums are f32; each gradient element is rounded once, after its whole sum is added.
template <class T, class S>
__global__ void norm_weight_grad_kernel(const T* dy, const T* x, const S* mean, const S* rstd,
                                        T* dw, T* db, std::int64_t rows, std::int64_t cols) {
  __shared__ float part_w[8][33];
  __shared__ float part_b[8][33];
  std::int64_t c = blockIdx.x * std::int64_t{32} + threadIdx.x;
  float aw = 0, ab = 0;
  if (c < cols) {
    for (std::int64_t r = threadIdx.y; r < rows; r += 8) {
      float g = to_f32(dy[r * cols + c]);
      float mu = mean != nullptr ? to_f32(mean[r]) : 0.0f;
      float xhat = (to_f32(x[r * cols + c]) - mu) * to_f32(rstd[r]);
      aw += g * xhat;
      ab += g;
    }
  }
  part_w[threadIdx.y][threadIdx.x] = aw;
  part_b[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float tw = 0, tb = 0;
    for (int k = 0; k < 8; ++k) {
      tw += part_w[k][threadIdx.x];
      tb += part_b[k][threadIdx.x];
    }
    detail::add_rounded(dw[c], tw);
    if (db != nullptr) detail::add_rounded(db[c], tb);
  }
}

template <class T, class S>
void launch_weight_grad(const tensor& dy, const tensor& x, const S* mean, const tensor& rstd,
                        const tensor& dw, T* db, std::int64_t rows, std::int64_t cols) {
  unsigned blocks = static_cast<unsigned>((cols + 31) / 32);
  norm_weight_grad_kernel<T, S><<<blocks, dim3(32, 8)>>>(ptr<T>(dy), ptr<T>(x), mean, ptr<S>(rstd),
                                                         ptr<T>(dw), db, rows, cols);
  TROUPE_CUDA_CHECK_LAUNCH();
}

// Calls f(T, S) with the data type T of x and the statistics type S of stat.
template <class F>
void dispatch_norm(const char* op, const tensor& x, const char* stat_name, const tensor& stat,
                   F&& f) {
  detail::dispatch_16_32(op, x, [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::dispatch_stat<T>(op, stat_name, stat, [&](auto stat_tag) {
      using S = typename decltype(stat_tag)::type;
      f(detail::type_tag<T>{}, detail::type_tag<S>{});
    });
  });
}

}  // namespace

void softmax(const tensor& x, const tensor& y) {
  std::int64_t rows = rows_of(x), cols = x.dim() == 0 ? 1 : x.size(-1);
  detail::dispatch_16_32("softmax", x, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rows == 0 || cols == 0) return;
    softmax_kernel<T><<<row_grid(rows), row_threads>>>(ptr<T>(x), ptr<T>(y), rows, cols);
    TROUPE_CUDA_CHECK_LAUNCH();
  });
}

void softmax_backward(const tensor& y, const tensor& dy, const tensor& dx) {
  std::int64_t rows = rows_of(y), cols = y.dim() == 0 ? 1 : y.size(-1);
  detail::dispatch_16_32("softmax_backward", y, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rows == 0 || cols == 0) return;
    softmax_backward_kernel<T>
        <<<row_grid(rows), row_threads>>>(ptr<T>(y), ptr<T>(dy), ptr<T>(dx), rows, cols);
    TROUPE_CUDA_CHECK_LAUNCH();
  });
}

void layernorm(const tensor& x, const tensor& w, const tensor& b, const tensor& y,
               const tensor& mean, const tensor& rstd, double eps) {
  std::int64_t rows = rows_of(x), cols = x.size(-1);
  TROUPE_CHECK(mean.type() == rstd.type(), "cuda layernorm: mean is ", dtype_name(mean.type()),
               " but rstd is ", dtype_name(rstd.type()));
  dispatch_norm("layernorm", x, "mean", mean, [&](auto tag, auto stat_tag) {
    using T = typename decltype(tag)::type;
    using S = typename decltype(stat_tag)::type;
    if (rows == 0 || cols == 0) return;
    layernorm_kernel<T, S><<<row_grid(rows), row_threads>>>(
        ptr<T>(x), ptr<T>(w), b.defined() ? ptr<T>(b) : nullptr, ptr<T>(y), ptr<S>(mean),
        ptr<S>(rstd), rows, cols, static_cast<float>(eps));
    TROUPE_CUDA_CHECK_LAUNCH();
  });
}

void layernorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& mean,
                        const tensor& rstd, const tensor& dx, const tensor& dw, const tensor& db) {
  std::int64_t rows = rows_of(x), cols = x.size(-1);
  TROUPE_CHECK(mean.type() == rstd.type(), "cuda layernorm_backward: mean is ",
               dtype_name(mean.type()), " but rstd is ", dtype_name(rstd.type()));
  dispatch_norm("layernorm_backward", x, "mean", mean, [&](auto tag, auto stat_tag) {
    using T = typename decltype(tag)::type;
    using S = typename decltype(stat_tag)::type;
    if (rows == 0 || cols == 0) return;
    launch_weight_grad<T, S>(dy, x, ptr<S>(mean), rstd, dw, db.defined() ? ptr<T>(db) : nullptr,
                             rows, cols);
    layernorm_backward_kernel<T, S><<<row_grid(rows), row_threads>>>(
        ptr<T>(dy), ptr<T>(x), ptr<T>(w), ptr<S>(mean), ptr<S>(rstd), ptr<T>(dx), rows, cols);
    TROUPE_CUDA_CHECK_LAUNCH();
  });
}

void rmsnorm(const tensor& x, const tensor& w, const tensor& y, const tensor& rstd, double eps) {
  std::int64_t rows = rows_of(x), cols = x.size(-1);
  dispatch_norm("rmsnorm", x, "rstd", rstd, [&](auto tag, auto stat_tag) {
    using T = typename decltype(tag)::type;
    using S = typename decltype(stat_tag)::type;
    if (rows == 0 || cols == 0) return;
    rmsnorm_kernel<T, S><<<row_grid(rows), row_threads>>>(
        ptr<T>(x), ptr<T>(w), ptr<T>(y), ptr<S>(rstd), rows, cols, static_cast<float>(eps));
    TROUPE_CUDA_CHECK_LAUNCH();
  });
}

void rmsnorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& rstd,
                      const tensor& dx, const tensor& dw) {
  std::int64_t rows = rows_of(x), cols = x.size(-1);
  dispatch_norm("rmsnorm_backward", x, "rstd", rstd, [&](auto tag, auto stat_tag) {
    using T = typename decltype(tag)::type;
    using S = typename decltype(stat_tag)::type;
    if (rows == 0 || cols == 0) return;
    launch_weight_grad<T, S>(dy, x, static_cast<const S*>(nullptr), rstd, dw,
                             static_cast<T*>(nullptr), rows, cols);
    rmsnorm_backward_kernel<T, S><<<row_grid(rows), row_threads>>>(
        ptr<T>(dy), ptr<T>(x), ptr<T>(w), ptr<S>(rstd), ptr<T>(dx), rows, cols);
    TROUPE_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace troupe::cuda
