// CUDA fill and copy: fill writes one bit pattern (any dtype); copy handles any strides up to
// max_dims dimensions, same-dtype copies of any dtype, and conversions among f32, bf16 and f16
// (and f32 <-> f64), rounding to nearest even.
#include <cmath>
#include <cstring>
#include <type_traits>

#include "tensor/backend.hpp"
#include "tensor/cuda/check.cuh"

namespace troupe::cuda {
namespace {

using detail::from_f32;
using detail::to_f32;

template <class T>
__global__ void fill_kernel(T* x, std::int64_t n, T value) {
  TROUPE_GRID_STRIDE(i, n) {
    x[i] = value;
  }
}

template <class T>
void launch_fill(const tensor& x, T bits) {
  std::int64_t n = x.numel();
  fill_kernel<T><<<detail::grid_for(n), detail::block_threads>>>(detail::ptr<T>(x), n, bits);
  TROUPE_CUDA_CHECK_LAUNCH();
}

// Sizes and strides (in elements) of src and dst, passed by value to the kernel.
struct copy_geometry {
  int rank = 0;
  std::int64_t sizes[max_dims] = {};
  std::int64_t src_strides[max_dims] = {};
  std::int64_t dst_strides[max_dims] = {};
};

// Same-type copies move raw bits; conversions go through f32 (or to and from f64 directly).
template <class S, class D>
struct convert {
  __device__ static D apply(S v) { return from_f32<D>(to_f32(v)); }
};
template <class T>
struct convert<T, T> {
  __device__ static T apply(T v) { return v; }
};
template <>
struct convert<double, float> {
  __device__ static float apply(double v) { return static_cast<float>(v); }
};
template <>
struct convert<float, double> {
  __device__ static double apply(float v) { return v; }
};

template <class S, class D>
__global__ void copy_kernel(const S* src, D* dst, std::int64_t n, copy_geometry g) {
  TROUPE_GRID_STRIDE(i, n) {
    std::int64_t rest = i, so = 0, d_o = 0;
    for (int d = g.rank - 1; d >= 0; --d) {
      std::int64_t idx = rest % g.sizes[d];
      rest /= g.sizes[d];
      so += idx * g.src_strides[d];
      d_o += idx * g.dst_strides[d];
    }
    dst[d_o] = convert<S, D>::apply(src[so]);
  }
}

template <class S, class D>
void launch_copy(const tensor& src, const tensor& dst) {
  std::int64_t n = src.numel();
  copy_geometry g;
  if (src.is_contiguous() && dst.is_contiguous()) {
    g.rank = 1;
    g.sizes[0] = n;
    g.src_strides[0] = g.dst_strides[0] = 1;
  } else {
    g.rank = src.dim();
    for (int d = 0; d < g.rank; ++d) {
      g.sizes[d] = src.size(d);
      g.src_strides[d] = src.stride(d);
      g.dst_strides[d] = dst.stride(d);
    }
  }
  copy_kernel<S, D><<<detail::grid_for(n), detail::block_threads>>>(
      static_cast<const S*>(src.data()), static_cast<D*>(dst.data()), n, g);
  TROUPE_CUDA_CHECK_LAUNCH();
}

// Calls f(type_tag<T>{}) for a floating dtype the copy kernels convert: f64, f32, bf16, f16.
template <class F>
bool dispatch_float(dtype t, F&& f) {
  switch (t) {
    case dtype::f64:
      f(detail::type_tag<double>{});
      return true;
    case dtype::f32:
      f(detail::type_tag<float>{});
      return true;
    case dtype::bf16:
      f(detail::type_tag<__nv_bfloat16>{});
      return true;
    case dtype::f16:
      f(detail::type_tag<__half>{});
      return true;
    default:
      return false;
  }
}

}  // namespace

void fill(const tensor& x, double value) {
  if (x.numel() == 0) return;
  if (value == 0.0 && !std::signbit(value)) {  // every dtype stores +0 as zero bytes
    TROUPE_CUDA_CHECK(cudaMemsetAsync(x.data(), 0, x.nbytes()));
    return;
  }
  switch (x.type()) {
    case dtype::f32: {
      float f = static_cast<float>(value);
      std::uint32_t bits;
      std::memcpy(&bits, &f, 4);
      return launch_fill<std::uint32_t>(x, bits);
    }
    case dtype::f64: {
      std::uint64_t bits;
      std::memcpy(&bits, &value, 8);
      return launch_fill<std::uint64_t>(x, bits);
    }
    case dtype::bf16:
      return launch_fill<std::uint16_t>(x, f32_to_bf16_bits(static_cast<float>(value)));
    case dtype::f16:
      return launch_fill<std::uint16_t>(x, f32_to_f16_bits(static_cast<float>(value)));
    case dtype::i32:
      return launch_fill<std::int32_t>(x, static_cast<std::int32_t>(value));
    case dtype::i64:
      return launch_fill<std::int64_t>(x, static_cast<std::int64_t>(value));
    case dtype::u8:
      return launch_fill<std::uint8_t>(x, static_cast<std::uint8_t>(value));
  }
  TROUPE_FAIL("cuda fill: dtype ", dtype_name(x.type()), " not supported");
}

void copy(const tensor& src, const tensor& dst) {
  if (src.numel() == 0) return;
  if (src.type() == dst.type()) {
    if (src.is_contiguous() && dst.is_contiguous()) {
      TROUPE_CUDA_CHECK(
          cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice));
      return;
    }
    switch (src.element_size()) {
      case 1:
        return launch_copy<std::uint8_t, std::uint8_t>(src, dst);
      case 2:
        return launch_copy<std::uint16_t, std::uint16_t>(src, dst);
      case 4:
        return launch_copy<std::uint32_t, std::uint32_t>(src, dst);
      case 8:
        return launch_copy<std::uint64_t, std::uint64_t>(src, dst);
      default:
        break;
    }
    TROUPE_FAIL("cuda copy: dtype ", dtype_name(src.type()), " not supported");
  }
  // f64 converts only to and from f32 (a direct f64 -> 16-bit rounding would differ from the
  // CPU's rounding through f32).
  bool f64_pair = (src.type() == dtype::f64 && dst.type() == dtype::f32) ||
                  (src.type() == dtype::f32 && dst.type() == dtype::f64);
  bool supported = f64_pair || (src.type() != dtype::f64 && dst.type() != dtype::f64);
  bool launched = false;
  if (supported) {
    dispatch_float(src.type(), [&](auto s) {
      using S = typename decltype(s)::type;
      launched = dispatch_float(dst.type(), [&](auto d) {
        using D = typename decltype(d)::type;
        if constexpr (std::is_same_v<S, double> || std::is_same_v<D, double>) {
          if constexpr ((std::is_same_v<S, double> && std::is_same_v<D, float>) ||
                        (std::is_same_v<S, float> && std::is_same_v<D, double>))
            launch_copy<S, D>(src, dst);
        } else {
          launch_copy<S, D>(src, dst);
        }
      });
    });
  }
  TROUPE_CHECK(launched, "cuda copy: cannot convert ", dtype_name(src.type()), " to ",
               dtype_name(dst.type()));
}

}  // namespace troupe::cuda
