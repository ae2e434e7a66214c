// CUDA softmax, layernorm and rmsnorm over the last dimension, f32. One block per row with
// warp-shuffle block reductions; the weight and bias gradients of the backwards are column sums
// done by a second kernel (no atomics, same result on every run), which runs first so that dx may
// alias dy or x.
#include "tensor/backend.hpp"
#include "tensor/cuda/check.cuh"

namespace troupe::cuda {
namespace {

using detail::block_max;
using detail::block_sum;
using detail::ptr;

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

__global__ void softmax_kernel(const float* x, float* y, std::int64_t rows, std::int64_t cols) {
  __shared__ float shared[32];
  TROUPE_FOR_ROWS(r, rows) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    float m = -INFINITY;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, xr[c]);
    m = block_max(m, shared);
    float s = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += expf(xr[c] - m);
    float inv = 1.0f / block_sum(s, shared);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = expf(xr[c] - m) * inv;
  }
}

__global__ void softmax_backward_kernel(const float* y, const float* dy, float* dx,
                                        std::int64_t rows, std::int64_t cols) {
  __shared__ float shared[32];
  TROUPE_FOR_ROWS(r, rows) {
    const float* yr = y + r * cols;
    const float* dyr = dy + r * cols;
    float* dxr = dx + r * cols;
    float s = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += yr[c] * dyr[c];
    s = block_sum(s, shared);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) dxr[c] = yr[c] * (dyr[c] - s);
  }
}

// b may be null.
__global__ void layernorm_kernel(const float* x, const float* w, const float* b, float* y,
                                 float* mean, float* rstd, std::int64_t rows, std::int64_t cols,
                                 float eps) {
  __shared__ float shared[32];
  const float inv_cols = 1.0f / static_cast<float>(cols);
  TROUPE_FOR_ROWS(r, rows) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    float s = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += xr[c];
    float mu = block_sum(s, shared) * inv_cols;
    float v = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float d = xr[c] - mu;
      v += d * d;
    }
    float rs = 1.0f / sqrtf(block_sum(v, shared) * inv_cols + eps);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      yr[c] = (xr[c] - mu) * rs * w[c] + (b != nullptr ? b[c] : 0.0f);
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

__global__ void layernorm_backward_kernel(const float* dy, const float* x, const float* w,
                                          const float* mean, const float* rstd, float* dx,
                                          std::int64_t rows, std::int64_t cols) {
  __shared__ float shared[32];
  const float inv_cols = 1.0f / static_cast<float>(cols);
  TROUPE_FOR_ROWS(r, rows) {
    const float* xr = x + r * cols;
    const float* dyr = dy + r * cols;
    float* dxr = dx + r * cols;
    const float mu = mean[r], rs = rstd[r];
    float sg = 0, sgx = 0;  // sums of g = dy * w and of g * xhat
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float g = dyr[c] * w[c];
      sg += g;
      sgx += g * (xr[c] - mu) * rs;
    }
    sg = block_sum(sg, shared) * inv_cols;
    sgx = block_sum(sgx, shared) * inv_cols;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float g = dyr[c] * w[c];
      float xhat = (xr[c] - mu) * rs;
      dxr[c] = rs * (g - sg - xhat * sgx);
    }
  }
}

__global__ void rmsnorm_kernel(const float* x, const float* w, float* y, float* rstd,
                               std::int64_t rows, std::int64_t cols, float eps) {
  __shared__ float shared[32];
  const float inv_cols = 1.0f / static_cast<float>(cols);
  TROUPE_FOR_ROWS(r, rows) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    float s = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += xr[c] * xr[c];
    float rs = 1.0f / sqrtf(block_sum(s, shared) * inv_cols + eps);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = xr[c] * rs * w[c];
    if (threadIdx.x == 0) rstd[r] = rs;
  }
}

// dx = rstd * (g - x * rstd^2 * mean(g * x)) with g = dy * w.
__global__ void rmsnorm_backward_kernel(const float* dy, const float* x, const float* w,
                                        const float* rstd, float* dx, std::int64_t rows,
                                        std::int64_t cols) {
  __shared__ float shared[32];
  const float inv_cols = 1.0f / static_cast<float>(cols);
  TROUPE_FOR_ROWS(r, rows) {
    const float* xr = x + r * cols;
    const float* dyr = dy + r * cols;
    float* dxr = dx + r * cols;
    const float rs = rstd[r];
    float s = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += dyr[c] * w[c] * xr[c];
    s = block_sum(s, shared) * inv_cols;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      dxr[c] = rs * (dyr[c] * w[c] - xr[c] * rs * rs * s);
  }
}

// dw[c] += sum_r dy[r,c] * xhat[r,c] and, if db is given, db[c] += sum_r dy[r,c], where xhat is
// (x - mean[r]) * rstd[r] (mean null: rmsnorm, xhat = x * rstd[r]). A block covers 32 columns.
__global__ void norm_weight_grad_kernel(const float* dy, const float* x, const float* mean,
                                        const float* rstd, float* dw, float* db, std::int64_t rows,
                                        std::int64_t cols) {
  __shared__ float part_w[8][33];
  __shared__ float part_b[8][33];
  std::int64_t c = blockIdx.x * std::int64_t{32} + threadIdx.x;
  float aw = 0, ab = 0;
  if (c < cols) {
    for (std::int64_t r = threadIdx.y; r < rows; r += 8) {
      float g = dy[r * cols + c];
      float xhat = (x[r * cols + c] - (mean != nullptr ? mean[r] : 0.0f)) * rstd[r];
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
    dw[c] += tw;
    if (db != nullptr) db[c] += tb;
  }
}

void launch_weight_grad(const tensor& dy, const tensor& x, const float* mean, const tensor& rstd,
                        const tensor& dw, float* db, std::int64_t rows, std::int64_t cols) {
  if (cols == 0) return;
  unsigned blocks = static_cast<unsigned>((cols + 31) / 32);
  norm_weight_grad_kernel<<<blocks, dim3(32, 8)>>>(
      ptr<float>(dy), ptr<float>(x), mean, ptr<float>(rstd), ptr<float>(dw), db, rows, cols);
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void softmax(const tensor& x, const tensor& y) {
  detail::need_f32("softmax", x);
  std::int64_t rows = rows_of(x), cols = x.dim() == 0 ? 1 : x.size(-1);
  if (rows == 0 || cols == 0) return;
  softmax_kernel<<<row_grid(rows), row_threads>>>(ptr<float>(x), ptr<float>(y), rows, cols);
  TROUPE_CUDA_CHECK_LAUNCH();
}

void softmax_backward(const tensor& y, const tensor& dy, const tensor& dx) {
  detail::need_f32("softmax_backward", y);
  std::int64_t rows = rows_of(y), cols = y.dim() == 0 ? 1 : y.size(-1);
  if (rows == 0 || cols == 0) return;
  softmax_backward_kernel<<<row_grid(rows), row_threads>>>(ptr<float>(y), ptr<float>(dy),
                                                           ptr<float>(dx), rows, cols);
  TROUPE_CUDA_CHECK_LAUNCH();
}

void layernorm(const tensor& x, const tensor& w, const tensor& b, const tensor& y,
               const tensor& mean, const tensor& rstd, double eps) {
  detail::need_f32("layernorm", x);
  std::int64_t rows = rows_of(x), cols = x.size(-1);
  if (rows == 0 || cols == 0) return;
  layernorm_kernel<<<row_grid(rows), row_threads>>>(
      ptr<float>(x), ptr<float>(w), b.defined() ? ptr<float>(b) : nullptr, ptr<float>(y),
      ptr<float>(mean), ptr<float>(rstd), rows, cols, static_cast<float>(eps));
  TROUPE_CUDA_CHECK_LAUNCH();
}

void layernorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& mean,
                        const tensor& rstd, const tensor& dx, const tensor& dw, const tensor& db) {
  detail::need_f32("layernorm_backward", x);
  std::int64_t rows = rows_of(x), cols = x.size(-1);
  if (rows == 0 || cols == 0) return;
  launch_weight_grad(dy, x, ptr<float>(mean), rstd, dw, db.defined() ? ptr<float>(db) : nullptr,
                     rows, cols);
  layernorm_backward_kernel<<<row_grid(rows), row_threads>>>(
      ptr<float>(dy), ptr<float>(x), ptr<float>(w), ptr<float>(mean), ptr<float>(rstd),
      ptr<float>(dx), rows, cols);
  TROUPE_CUDA_CHECK_LAUNCH();
}

void rmsnorm(const tensor& x, const tensor& w, const tensor& y, const tensor& rstd, double eps) {
  detail::need_f32("rmsnorm", x);
  std::int64_t rows = rows_of(x), cols = x.size(-1);
  if (rows == 0 || cols == 0) return;
  rmsnorm_kernel<<<row_grid(rows), row_threads>>>(ptr<float>(x), ptr<float>(w), ptr<float>(y),
                                                  ptr<float>(rstd), rows, cols,
                                                  static_cast<float>(eps));
  TROUPE_CUDA_CHECK_LAUNCH();
}

void rmsnorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& rstd,
                      const tensor& dx, const tensor& dw) {
  detail::need_f32("rmsnorm_backward", x);
  std::int64_t rows = rows_of(x), cols = x.size(-1);
  if (rows == 0 || cols == 0) return;
  launch_weight_grad(dy, x, nullptr, rstd, dw, nullptr, rows, cols);
  rmsnorm_backward_kernel<<<row_grid(rows), row_threads>>>(
      ptr<float>(dy), ptr<float>(x), ptr<float>(w), ptr<float>(rstd), ptr<float>(dx), rows, cols);
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::cuda
