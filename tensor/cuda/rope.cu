// CUDA rotary position embedding (HF rotate-half convention) for f32, bf16 and f16: the cos/sin
// tables and the rotation of strided [B, T, H, D] views.
//
// The tables follow HF's float32 arithmetic step by step, like the CPU backend, so they match a
// PyTorch reference: inv_freq in float as HF computes it, scaling included (the CPU backend's code,
// tensor/rope_frequency.hpp), angle = float(position) * inv_freq in float, cos and sin of that
// angle computed in double and rounded to float; 16-bit tables round those f32 values once more
// (HF builds them in f32 and casts them to the model's dtype). The rotation loads x and the tables
// to f32 and rounds y once; the tables may be in x's dtype or in f32.
#include "tensor/backend.hpp"
#include "tensor/cuda/check.cuh"
#include "tensor/rope_frequency.hpp"

namespace troupe::cuda {
namespace {

using detail::from_f32;
using detail::ptr;
using detail::to_f32;

// One table element per thread: k = t * half + i.
template <class T>
__global__ void rope_tables_kernel(T* cos_t, T* sin_t, std::int64_t rows, std::int64_t half,
                                   std::int64_t start, ops::rope_options opt) {
  TROUPE_GRID_STRIDE(k, rows * half) {
    std::int64_t t = k / half, i = k % half;
    const float inv_freq = troupe::detail::rope_inv_freq<float>(i, 2 * half, opt);
    const double angle = static_cast<double>(static_cast<float>(start + t) * inv_freq);
    cos_t[k] = from_f32<T>(static_cast<float>(cos(angle)));
    sin_t[k] = from_f32<T>(static_cast<float>(sin(angle)));
  }
}

// Strides in elements of a [B, T, H, D] view whose last dimension is contiguous.
struct bthd {
  std::int64_t b, t, h;
};
bthd strides_of(const tensor& x) {
  return {x.stride(0), x.stride(1), x.stride(2)};
}

// T: x and y; C: the tables (T or float).
template <class T, class C>
__global__ void rope_kernel(const T* x, bthd xs, const C* cos_t, const C* sin_t, T* y, bthd ys,
                            std::int64_t batch, std::int64_t steps, std::int64_t heads,
                            std::int64_t half, bool inverse) {
  TROUPE_GRID_STRIDE(k, batch * steps * heads * half) {
    std::int64_t i = k % half, rest = k / half;
    std::int64_t h = rest % heads;
    rest /= heads;
    std::int64_t t = rest % steps, b = rest / steps;
    const T* xp = x + b * xs.b + t * xs.t + h * xs.h;
    T* yp = y + b * ys.b + t * ys.t + h * ys.h;
    float c = to_f32(cos_t[t * half + i]), s = to_f32(sin_t[t * half + i]);
    float x1 = to_f32(xp[i]), x2 = to_f32(xp[i + half]);  // both read before either write
    if (inverse) s = -s;
    yp[i] = from_f32<T>(x1 * c - x2 * s);
    yp[i + half] = from_f32<T>(x2 * c + x1 * s);
  }
}

}  // namespace

void rope_tables(std::int64_t start, const ops::rope_options& opt, const tensor& cos,
                 const tensor& sin) {
  std::int64_t rows = cos.size(0), half = cos.size(1);
  detail::dispatch_16_32("rope_tables", cos, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rows * half == 0) return;
    rope_tables_kernel<T><<<detail::grid_for(rows * half), detail::block_threads>>>(
        ptr<T>(cos), ptr<T>(sin), rows, half, start, opt);
    TROUPE_CUDA_CHECK_LAUNCH();
  });
}

void rope(const tensor& x, const tensor& cos, const tensor& sin, const tensor& y, bool inverse) {
  std::int64_t batch = x.size(0), steps = x.size(1), heads = x.size(2), half = x.size(3) / 2;
  std::int64_t n = batch * steps * heads * half;
  TROUPE_CHECK(cos.type() == sin.type(), "cuda rope: cos is ", dtype_name(cos.type()),
               " but sin is ", dtype_name(sin.type()));
  detail::dispatch_16_32("rope", x, [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::dispatch_stat<T>("rope", "cos", cos, [&](auto table_tag) {
      using C = typename decltype(table_tag)::type;
      if (n == 0) return;
      rope_kernel<T, C><<<detail::grid_for(n), detail::block_threads>>>(
          ptr<T>(x), strides_of(x), ptr<C>(cos), ptr<C>(sin), ptr<T>(y), strides_of(y), batch,
          steps, heads, half, inverse);
      TROUPE_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace troupe::cuda
