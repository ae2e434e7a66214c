// CUDA rotary position embedding (HF rotate-half convention), f32: the cos/sin tables (angles in
// f64, like the definition in ops.hpp) and the rotation of strided [B, T, H, D] views.
#include "tensor/backend.hpp"
#include "tensor/cuda/check.cuh"

namespace troupe::cuda {
namespace {

using detail::ptr;

__global__ void rope_tables_kernel(float* cos_t, float* sin_t, std::int64_t rows, std::int64_t half,
                                   std::int64_t start, double theta) {
  TROUPE_GRID_STRIDE(k, rows * half) {
    std::int64_t t = k / half, i = k % half;
    // theta^(-2i/D) with D = 2 * half
    double angle = static_cast<double>(start + t) *
                   pow(theta, -static_cast<double>(i) / static_cast<double>(half));
    cos_t[k] = static_cast<float>(cos(angle));
    sin_t[k] = static_cast<float>(sin(angle));
  }
}

// Strides in elements of a [B, T, H, D] view whose last dimension is contiguous.
struct bthd {
  std::int64_t b, t, h;
};
bthd strides_of(const tensor& x) {
  return {x.stride(0), x.stride(1), x.stride(2)};
}

__global__ void rope_kernel(const float* x, bthd xs, const float* cos_t, const float* sin_t,
                            float* y, bthd ys, std::int64_t batch, std::int64_t steps,
                            std::int64_t heads, std::int64_t half, bool inverse) {
  TROUPE_GRID_STRIDE(k, batch * steps * heads * half) {
    std::int64_t i = k % half, rest = k / half;
    std::int64_t h = rest % heads;
    rest /= heads;
    std::int64_t t = rest % steps, b = rest / steps;
    const float* xp = x + b * xs.b + t * xs.t + h * xs.h;
    float* yp = y + b * ys.b + t * ys.t + h * ys.h;
    float c = cos_t[t * half + i], s = sin_t[t * half + i];
    float x1 = xp[i], x2 = xp[i + half];  // both read before either write: y may alias x
    if (inverse) s = -s;
    yp[i] = x1 * c - x2 * s;
    yp[i + half] = x2 * c + x1 * s;
  }
}

}  // namespace

void rope_tables(std::int64_t start, double theta, const tensor& cos, const tensor& sin) {
  detail::need_f32("rope_tables", cos);
  std::int64_t rows = cos.size(0), half = cos.size(1);
  if (rows * half == 0) return;
  rope_tables_kernel<<<detail::grid_for(rows * half), detail::block_threads>>>(
      ptr<float>(cos), ptr<float>(sin), rows, half, start, theta);
  TROUPE_CUDA_CHECK_LAUNCH();
}

void rope(const tensor& x, const tensor& cos, const tensor& sin, const tensor& y, bool inverse) {
  detail::need_f32("rope", x);
  std::int64_t batch = x.size(0), steps = x.size(1), heads = x.size(2), half = x.size(3) / 2;
  std::int64_t n = batch * steps * heads * half;
  if (n == 0) return;
  rope_kernel<<<detail::grid_for(n), detail::block_threads>>>(
      ptr<float>(x), strides_of(x), ptr<float>(cos), ptr<float>(sin), ptr<float>(y), strides_of(y),
      batch, steps, heads, half, inverse);
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::cuda
