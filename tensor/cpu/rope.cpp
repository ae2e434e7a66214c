// CPU backend: rotary position embedding tables and their application (HF rotate-half).
//
// The f32 tables follow HF's float32 arithmetic step by step, so they match a PyTorch reference:
// inv_freq in float as HF computes it, scaling included (tensor/rope_frequency.hpp), angle =
// float(position) * inv_freq in float, then cos and sin of that float angle (computed in double
// and rounded once). The f64 tables do the same in double; bf16 and f16 tables are the f32 ones
// rounded. bf16 and f16 vectors rotate in f32 and round once.
#include <cmath>

#include "tensor/backend.hpp"
#include "tensor/cpu/half.hpp"
#include "tensor/cpu/kernel_util.hpp"
#include "tensor/parallel.hpp"
#include "tensor/rope_frequency.hpp"

namespace troupe::cpu {
namespace {

// One head vector of D = 2 * half elements. inverse applies the transposed rotation.
template <class T, bool inverse>
inline void rotate(const T* __restrict x, T* __restrict y, const T* c, const T* s,
                   std::int64_t half) {
  for (std::int64_t i = 0; i < half; ++i) {
    T x1 = x[i], x2 = x[i + half];
    if constexpr (inverse) {
      y[i] = x1 * c[i] + x2 * s[i];
      y[i + half] = x2 * c[i] - x1 * s[i];
    } else {
      y[i] = x1 * c[i] - x2 * s[i];
      y[i + half] = x2 * c[i] + x1 * s[i];
    }
  }
}

// The same in place: one pointer, so the compiler sees that element i is read before it is
// written and vectorizes without a runtime overlap check.
template <class T, bool inverse>
inline void rotate_in_place(T* p, const T* c, const T* s, std::int64_t half) {
  T* __restrict p1 = p;
  T* __restrict p2 = p + half;
  for (std::int64_t i = 0; i < half; ++i) {
    T x1 = p1[i], x2 = p2[i];
    if constexpr (inverse) {
      p1[i] = x1 * c[i] + x2 * s[i];
      p2[i] = x2 * c[i] - x1 * s[i];
    } else {
      p1[i] = x1 * c[i] - x2 * s[i];
      p2[i] = x2 * c[i] + x1 * s[i];
    }
  }
}

// A 16-bit head vector: blocks of both halves and of the tables are widened to f32, rotated in
// place and rounded once. x and y may be the same vector.
template <class S, bool inverse>
inline void rotate_half_storage(const S* x, S* y, const S* c, const S* s, std::int64_t half) {
  constexpr std::int64_t blk = half_block;
  float v[2 * blk], cf[blk], sf[blk];
  for (std::int64_t i0 = 0; i0 < half; i0 += blk) {
    const std::int64_t len = std::min(blk, half - i0);
    widen_n(x + i0, v, len);
    widen_n(x + half + i0, v + len, len);
    widen_n(c + i0, cf, len);
    widen_n(s + i0, sf, len);
    rotate_in_place<float, inverse>(v, cf, sf, len);
    narrow_n(v, y + i0, len);
    narrow_n(v + len, y + half + i0, len);
  }
}

template <class T, bool inverse>
void rope_typed(const tensor& x, const tensor& cos, const tensor& sin, const tensor& y) {
  const std::int64_t nb = x.size(0), nt = x.size(1), nh = x.size(2), half = x.size(3) / 2;
  const T* xp = static_cast<const T*>(x.data());
  T* yp = static_cast<T*>(y.data());
  const T* cp = static_cast<const T*>(cos.data());
  const T* sp = static_cast<const T*>(sin.data());
  const bool in_place = x.data() == y.data() && x.strides() == y.strides();
  parallel::parallel_for(
      0, nb * nt * nh, row_grain(2 * half), [&](std::int64_t lo, std::int64_t hi) {
        for (std::int64_t r = lo; r < hi; ++r) {
          const std::int64_t h = r % nh, t = (r / nh) % nt, b = r / (nh * nt);
          const T* c = cp + t * half;
          const T* s = sp + t * half;
          T* yr = yp + b * y.stride(0) + t * y.stride(1) + h * y.stride(2);
          if constexpr (is_half<T>) {
            rotate_half_storage<T, inverse>(
                in_place ? yr : xp + b * x.stride(0) + t * x.stride(1) + h * x.stride(2), yr, c, s,
                half);
          } else if (in_place) {
            rotate_in_place<T, inverse>(yr, c, s, half);
          } else {
            rotate<T, inverse>(xp + b * x.stride(0) + t * x.stride(1) + h * x.stride(2), yr, c, s,
                               half);
          }
        }
      });
}

}  // namespace

// 16-bit tables hold the f32 tables rounded once (HF casts its f32 cos and sin to the activations'
// dtype the same way).
void rope_tables(std::int64_t start, const ops::rope_options& opt, const tensor& cos,
                 const tensor& sin) {
  dispatch_floating("rope_tables", cos.type(), [&]<class S>(S) {
    using T = compute_t<S>;
    const std::int64_t nt = cos.size(0), half = cos.size(1), d = 2 * half;
    S* cp = static_cast<S*>(cos.data());
    S* sp = static_cast<S*>(sin.data());
    // One column (frequency) per task: inv_freq once, then every position.
    parallel::parallel_for(
        0, half, std::max<std::int64_t>(1, exp_grain / std::max<std::int64_t>(nt, 1)),
        [&](std::int64_t lo, std::int64_t hi) {
          for (std::int64_t i = lo; i < hi; ++i) {
            const T inv_freq = troupe::detail::rope_inv_freq<T>(i, d, opt);
            for (std::int64_t t = 0; t < nt; ++t) {
              const double angle = static_cast<double>(static_cast<T>(start + t) * inv_freq);
              cp[t * half + i] = from_compute<S>(static_cast<T>(std::cos(angle)));
              sp[t * half + i] = from_compute<S>(static_cast<T>(std::sin(angle)));
            }
          }
        });
  });
}

void rope(const tensor& x, const tensor& cos, const tensor& sin, const tensor& y, bool inverse) {
  dispatch_floating("rope", x.type(), [&]<class T>(T) {
    if (inverse) {
      rope_typed<T, true>(x, cos, sin, y);
    } else {
      rope_typed<T, false>(x, cos, sin, y);
    }
  });
}

}  // namespace troupe::cpu
