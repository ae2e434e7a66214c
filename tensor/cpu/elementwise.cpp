// CPU backend: fill, strided copy with dtype conversion, elementwise arithmetic and reductions.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "memory/error.hpp"
#include "tensor/backend.hpp"
#include "tensor/cpu/half.hpp"
#include "tensor/cpu/kernel_util.hpp"
#include "tensor/parallel.hpp"

namespace troupe::cpu {
namespace {

// ---- fill -------------------------------------------------------------------------------------

template <class T>
void fill_with(const tensor& x, T v) {
  T* p = static_cast<T*>(x.data());
  parallel::parallel_for(0, x.numel(), elem_grain,
                         [&](std::int64_t lo, std::int64_t hi) { std::fill(p + lo, p + hi, v); });
}

template <class I>
I integer_value(double value, dtype t) {
  TROUPE_CHECK(std::nearbyint(value) == value &&
                   value >= static_cast<double>(std::numeric_limits<I>::min()) &&
                   value <= static_cast<double>(std::numeric_limits<I>::max()),
               "cpu fill: value ", value, " is not representable as ", dtype_name(t));
  return static_cast<I>(value);
}

// ---- copy -------------------------------------------------------------------------------------

// Each floating type widens to the type its arithmetic happens in (f32 for the 16-bit types), and
// narrows back with the round-to-nearest-even converters of tensor/dtype.hpp. f64 reaches bf16 and
// f16 through f32, so it is rounded twice (a tie-breaking difference in rare cases).
template <class S>
inline auto widen(S v) {
  if constexpr (std::is_same_v<S, bf16_t>) {
    return bf16_bits_to_f32(v.bits);
  } else if constexpr (std::is_same_v<S, f16_t>) {
    return f16_bits_to_f32(v.bits);
  } else {
    return v;
  }
}

template <class D, class W>
inline D narrow(W v) {
  if constexpr (std::is_same_v<D, bf16_t>) {
    return {f32_to_bf16_bits(static_cast<float>(v))};
  } else if constexpr (std::is_same_v<D, f16_t>) {
    return {f32_to_f16_bits(static_cast<float>(v))};
  } else {
    return static_cast<D>(v);
  }
}

// The raw element type for same-dtype copies: only the size matters.
template <std::size_t N>
using raw = std::conditional_t<
    N == 1, std::uint8_t,
    std::conditional_t<N == 2, std::uint16_t,
                       std::conditional_t<N == 4, std::uint32_t, std::uint64_t>>>;

// A copy's iteration space after dropping unit dimensions, ordering dimensions by destination
// stride (so the innermost loop writes as contiguously as possible) and merging dimensions that
// are contiguous with each other in both tensors.
struct copy_plan {
  int rank = 0;
  std::int64_t size[max_dims];
  std::int64_t src_stride[max_dims];
  std::int64_t dst_stride[max_dims];
};

copy_plan plan_copy(const tensor& src, const tensor& dst) {
  copy_plan p;
  for (int d = 0; d < src.dim(); ++d) {
    if (src.size(d) == 1) continue;
    p.size[p.rank] = src.size(d);
    p.src_stride[p.rank] = src.stride(d);
    p.dst_stride[p.rank] = dst.stride(d);
    ++p.rank;
  }
  // Stable insertion sort: largest destination stride outermost.
  for (int i = 1; i < p.rank; ++i) {
    for (int j = i; j > 0 && p.dst_stride[j - 1] < p.dst_stride[j]; --j) {
      std::swap(p.size[j - 1], p.size[j]);
      std::swap(p.src_stride[j - 1], p.src_stride[j]);
      std::swap(p.dst_stride[j - 1], p.dst_stride[j]);
    }
  }
  // Merge dimension i into the kept one before it when that one steps over exactly one run of i
  // in both tensors.
  int r = 0;
  for (int i = 0; i < p.rank; ++i) {
    if (r > 0 && p.src_stride[r - 1] == p.src_stride[i] * p.size[i] &&
        p.dst_stride[r - 1] == p.dst_stride[i] * p.size[i]) {
      p.size[r - 1] *= p.size[i];
      p.src_stride[r - 1] = p.src_stride[i];
      p.dst_stride[r - 1] = p.dst_stride[i];
    } else {
      p.size[r] = p.size[i];
      p.src_stride[r] = p.src_stride[i];
      p.dst_stride[r] = p.dst_stride[i];
      ++r;
    }
  }
  p.rank = r;
  if (p.rank == 0) {  // a single element
    p.rank = 1;
    p.size[0] = 1;
    p.src_stride[0] = p.dst_stride[0] = 1;
  }
  return p;
}

template <class S, class D>
inline D convert(S v) {
  if constexpr (std::is_same_v<S, D>) {
    return v;
  } else {
    return narrow<D>(widen(v));
  }
}

// n elements from s (step ss) to d (step ds). Contiguous f32 <-> bf16/f16 runs use the vector
// converters of half.hpp (F16C for f16), which round to nearest even exactly like the scalar ones
// (NaN payloads aside).
template <class S, class D>
inline void copy_run(const S* s, D* d, std::int64_t n, std::int64_t ss, std::int64_t ds) {
  if constexpr (std::is_same_v<S, D>) {
    if (ss == 1 && ds == 1) {
      std::memcpy(d, s, static_cast<std::size_t>(n) * sizeof(S));
      return;
    }
  }
  if (ss != 1 || ds != 1) {
    for (std::int64_t i = 0; i < n; ++i) d[i * ds] = convert<S, D>(s[i * ss]);
    return;
  }
  if constexpr (std::is_same_v<S, float> && is_half<D>) {
    narrow_n(s, d, n);
  } else if constexpr (is_half<S> && std::is_same_v<D, float>) {
    widen_n(s, d, n);
  } else {
    for (std::int64_t i = 0; i < n; ++i) d[i] = convert<S, D>(s[i]);
  }
}

// The last two plan dimensions form a transpose (the destination is contiguous along the last,
// the source along the one before): copy them in square tiles so that reads and writes both use
// whole cache lines instead of one element per line on the strided side.
inline constexpr std::int64_t copy_tile = 32;

inline bool is_transpose(const copy_plan& p) {
  const int r = p.rank;
  return r >= 2 && p.dst_stride[r - 1] == 1 && p.src_stride[r - 1] != 1 && p.src_stride[r - 2] == 1;
}

template <class S, class D>
void copy_tiled(const copy_plan& p, const S* s, D* d) {
  const int r = p.rank;
  const std::int64_t rows = p.size[r - 2], cols = p.size[r - 1];
  const std::int64_t s_col = p.src_stride[r - 1], d_row = p.dst_stride[r - 2];
  std::int64_t outer = 1;
  for (int k = 0; k < r - 2; ++k) outer *= p.size[k];
  const std::int64_t row_tiles = (rows + copy_tile - 1) / copy_tile;
  const std::int64_t grain = row_grain(copy_tile * cols);
  parallel::parallel_for(0, outer * row_tiles, grain, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t u = lo; u < hi; ++u) {
      std::int64_t o = u / row_tiles;
      const std::int64_t i0 = (u % row_tiles) * copy_tile, i1 = std::min(rows, i0 + copy_tile);
      std::int64_t so = 0, dof = 0;
      for (int k = r - 3; k >= 0; --k) {
        const std::int64_t ik = o % p.size[k];
        o /= p.size[k];
        so += ik * p.src_stride[k];
        dof += ik * p.dst_stride[k];
      }
      for (std::int64_t j0 = 0; j0 < cols; j0 += copy_tile) {
        const std::int64_t j1 = std::min(cols, j0 + copy_tile);
        for (std::int64_t i = i0; i < i1; ++i) {
          const S* sr = s + so + i;
          D* dr = d + dof + i * d_row;
          for (std::int64_t j = j0; j < j1; ++j) dr[j] = convert<S, D>(sr[j * s_col]);
        }
      }
    }
  });
}

// Walks the plan's linear index range [lo, hi): outer dimensions by an odometer, the innermost
// one as runs handed to copy_run.
template <class S, class D>
void copy_typed(const tensor& src, const tensor& dst) {
  const copy_plan p = plan_copy(src, dst);
  const S* s = static_cast<const S*>(src.data());
  D* d = static_cast<D*>(dst.data());
  if (is_transpose(p)) return copy_tiled(p, s, d);
  const int inner_dim = p.rank - 1;
  const std::int64_t inner = p.size[inner_dim];
  const std::int64_t total = src.numel();
  parallel::parallel_for(0, total, elem_grain, [&](std::int64_t lo, std::int64_t hi) {
    std::int64_t idx[max_dims] = {};
    std::int64_t outer = lo / inner;
    std::int64_t i = lo % inner;
    std::int64_t so = 0, dof = 0;
    for (int k = inner_dim - 1; k >= 0; --k) {
      idx[k] = outer % p.size[k];
      outer /= p.size[k];
      so += idx[k] * p.src_stride[k];
      dof += idx[k] * p.dst_stride[k];
    }
    const std::int64_t ss = p.src_stride[inner_dim], ds = p.dst_stride[inner_dim];
    while (lo < hi) {
      std::int64_t len = std::min(inner - i, hi - lo);
      copy_run(s + so + i * ss, d + dof + i * ds, len, ss, ds);
      lo += len;
      i = 0;
      for (int k = inner_dim - 1; k >= 0; --k) {  // odometer step over the outer dimensions
        so += p.src_stride[k];
        dof += p.dst_stride[k];
        if (++idx[k] < p.size[k]) break;
        so -= p.size[k] * p.src_stride[k];
        dof -= p.size[k] * p.dst_stride[k];
        idx[k] = 0;
      }
    }
  });
}

template <class S>
void copy_from(const tensor& src, const tensor& dst) {
  switch (dst.type()) {
    case dtype::f32:
      return copy_typed<S, float>(src, dst);
    case dtype::f64:
      return copy_typed<S, double>(src, dst);
    case dtype::bf16:
      return copy_typed<S, bf16_t>(src, dst);
    case dtype::f16:
      return copy_typed<S, f16_t>(src, dst);
    default:
      break;
  }
  TROUPE_FAIL("cpu copy: cannot convert ", dtype_name(src.type()), " to ", dtype_name(dst.type()));
}

}  // namespace

void fill(const tensor& x, double value) {
  switch (x.type()) {
    case dtype::f32:
      return fill_with(x, static_cast<float>(value));
    case dtype::f64:
      return fill_with(x, value);
    case dtype::bf16:
      return fill_with(x, f32_to_bf16_bits(static_cast<float>(value)));
    case dtype::f16:
      return fill_with(x, f32_to_f16_bits(static_cast<float>(value)));
    case dtype::i32:
      return fill_with(x, integer_value<std::int32_t>(value, x.type()));
    case dtype::i64:
      return fill_with(x, integer_value<std::int64_t>(value, x.type()));
    case dtype::u8:
      return fill_with(x, integer_value<std::uint8_t>(value, x.type()));
  }
  TROUPE_FAIL("cpu fill: dtype ", dtype_name(x.type()), " not supported");
}

void copy(const tensor& src, const tensor& dst) {
  if (src.numel() == 0) return;
  if (src.type() == dst.type()) {
    if (src.data() == dst.data() && src.strides() == dst.strides()) return;
    if (src.is_contiguous() && dst.is_contiguous()) {
      const char* s = static_cast<const char*>(src.data());
      char* d = static_cast<char*>(dst.data());
      const std::int64_t bytes = static_cast<std::int64_t>(src.nbytes());
      parallel::parallel_for(0, bytes, 1 << 20, [&](std::int64_t lo, std::int64_t hi) {
        std::memcpy(d + lo, s + lo, static_cast<std::size_t>(hi - lo));
      });
      return;
    }
    switch (src.element_size()) {
      case 1:
        return copy_typed<raw<1>, raw<1>>(src, dst);
      case 2:
        return copy_typed<raw<2>, raw<2>>(src, dst);
      case 4:
        return copy_typed<raw<4>, raw<4>>(src, dst);
      case 8:
        return copy_typed<raw<8>, raw<8>>(src, dst);
    }
  }
  switch (src.type()) {
    case dtype::f32:
      return copy_from<float>(src, dst);
    case dtype::f64:
      return copy_from<double>(src, dst);
    case dtype::bf16:
      return copy_from<bf16_t>(src, dst);
    case dtype::f16:
      return copy_from<f16_t>(src, dst);
    default:
      break;
  }
  TROUPE_FAIL("cpu copy: cannot convert ", dtype_name(src.type()), " to ", dtype_name(dst.type()));
}

// ---- elementwise arithmetic ---------------------------------------------------------------------
// bf16 and f16 tensors compute in f32 and round each result once (map_elements, half.hpp).

void add(const tensor& a, const tensor& b, const tensor& out) {
  dispatch_floating("add", a.type(), [&]<class S>(S) {
    map_elements(
        a.numel(), elem_grain, static_cast<S*>(out.data()), [](auto x, auto y) { return x + y; },
        static_cast<const S*>(a.data()), static_cast<const S*>(b.data()));
  });
}

void mul(const tensor& a, const tensor& b, const tensor& out) {
  dispatch_floating("mul", a.type(), [&]<class S>(S) {
    map_elements(
        a.numel(), elem_grain, static_cast<S*>(out.data()), [](auto x, auto y) { return x * y; },
        static_cast<const S*>(a.data()), static_cast<const S*>(b.data()));
  });
}

void axpy(double alpha, const tensor& x, const tensor& y) {
  dispatch_floating("axpy", x.type(), [&]<class S>(S) {
    using C = compute_t<S>;
    const C al = static_cast<C>(alpha);
    S* yp = static_cast<S*>(y.data());
    map_elements(
        x.numel(), elem_grain, yp, [al](C xi, C yi) { return yi + al * xi; },
        static_cast<const S*>(x.data()), static_cast<const S*>(yp));
  });
}

void scale(const tensor& x, double alpha) {
  dispatch_floating("scale", x.type(), [&]<class S>(S) {
    using C = compute_t<S>;
    const C al = static_cast<C>(alpha);
    S* p = static_cast<S*>(x.data());
    map_elements(
        x.numel(), elem_grain, p, [al](C v) { return v * al; }, static_cast<const S*>(p));
  });
}

void add_bias(const tensor& x, const tensor& bias) {
  dispatch_floating("add_bias", x.type(), [&]<class S>(S) {
    S* p = static_cast<S*>(x.data());
    const S* b = static_cast<const S*>(bias.data());
    const std::int64_t c = x.size(-1);
    const std::int64_t n = c == 0 ? 0 : x.numel() / c;
    parallel::parallel_for(0, n, row_grain(c), [&](std::int64_t lo, std::int64_t hi) {
      if constexpr (is_half<S>) {
        float* bf = thread_floats(static_cast<std::size_t>(c));  // the bias in f32, once per chunk
        widen_n(b, bf, c);
        float t[half_block];
        for (std::int64_t r = lo; r < hi; ++r) {
          S* row = p + r * c;
          for (std::int64_t j0 = 0; j0 < c; j0 += half_block) {
            const std::int64_t len = std::min(half_block, c - j0);
            widen_n(row + j0, t, len);
            for (std::int64_t j = 0; j < len; ++j) t[j] += bf[j0 + j];
            narrow_n(t, row + j0, len);
          }
        }
      } else {
        for (std::int64_t r = lo; r < hi; ++r) {
          S* row = p + r * c;
          for (std::int64_t j = 0; j < c; ++j) row[j] += b[j];
        }
      }
    });
  });
}

void sum_rows(const tensor& x, const tensor& out) {
  dispatch_floating("sum_rows", x.type(), [&]<class S>(S) {
    using C = compute_t<S>;
    const S* p = static_cast<const S*>(x.data());
    S* o = static_cast<S*>(out.data());
    const std::int64_t c = x.size(-1);
    const std::int64_t n = c == 0 ? 0 : x.numel() / c;
    for_column_tiles(n, c, [&](std::int64_t c0, std::int64_t c1) {
      double acc[max_col_tile] = {};
      const std::int64_t w = c1 - c0;
      for (std::int64_t r = 0; r < n; ++r) {
        if constexpr (is_half<S>) {
          float row[max_col_tile];
          widen_n(p + r * c + c0, row, w);
          for (std::int64_t j = 0; j < w; ++j) acc[j] += static_cast<double>(row[j]);
        } else {
          const S* row = p + r * c + c0;
          for (std::int64_t j = 0; j < w; ++j) acc[j] += static_cast<double>(row[j]);
        }
      }
      for (std::int64_t j = 0; j < w; ++j)
        o[c0 + j] = from_compute<S>(to_compute(o[c0 + j]) + static_cast<C>(acc[j]));
    });
  });
}

namespace {
// Sum of f(x[i]) over the whole tensor in double lanes (f maps a double to a double). 16-bit
// elements are widened a block at a time.
template <class S, class F>
double reduce_values(const tensor& x, F&& f) {
  const S* p = static_cast<const S*>(x.data());
  return reduce_chunks(x.numel(), elem_grain, [&](std::int64_t lo, std::int64_t hi) {
    if constexpr (is_half<S>) {
      double total = 0;
      float t[half_block];
      for (std::int64_t b = lo; b < hi; b += half_block) {
        const std::int64_t len = std::min(half_block, hi - b);
        widen_n(p + b, t, len);
        total +=
            lane_sum<double>(0, len, [&](std::int64_t i) { return f(static_cast<double>(t[i])); });
      }
      return total;
    } else {
      return lane_sum<double>(lo, hi, [&](std::int64_t i) { return f(static_cast<double>(p[i])); });
    }
  });
}
}  // namespace

double sum(const tensor& x) {
  return dispatch_floating(
      "sum", x.type(), [&]<class S>(S) { return reduce_values<S>(x, [](double v) { return v; }); });
}

double sum_squares(const tensor& x) {
  return dispatch_floating("sum_squares", x.type(), [&]<class S>(S) {
    return reduce_values<S>(x, [](double v) { return v * v; });
  });
}

namespace {
// 1 if an element of [lo, hi) has all exponent bits set (inf or NaN), else 0.
template <class U>
double any_nonfinite(const U* bits, std::int64_t lo, std::int64_t hi, U exp_mask) {
  constexpr int w = 16;
  U acc[w] = {};
  std::int64_t i = lo;
  for (; i + w <= hi; i += w)
    for (int j = 0; j < w; ++j) acc[j] |= static_cast<U>((bits[i + j] & exp_mask) == exp_mask);
  U bad = 0;
  for (int j = 0; j < w; ++j) bad |= acc[j];
  for (; i < hi; ++i) bad |= static_cast<U>((bits[i] & exp_mask) == exp_mask);
  return static_cast<double>(bad);
}

template <class U>
bool all_finite_bits(const tensor& x, U exp_mask) {
  const U* bits = static_cast<const U*>(x.data());
  return reduce_chunks(x.numel(), elem_grain, [&](std::int64_t lo, std::int64_t hi) {
           return any_nonfinite(bits, lo, hi, exp_mask);
         }) == 0;
}
}  // namespace

bool all_finite(const tensor& x) {
  switch (x.type()) {
    case dtype::f32:
      return all_finite_bits<std::uint32_t>(x, 0x7f800000u);
    case dtype::f64:
      return all_finite_bits<std::uint64_t>(x, 0x7ff0000000000000ull);
    case dtype::bf16:
      return all_finite_bits<std::uint16_t>(x, 0x7f80u);
    case dtype::f16:
      return all_finite_bits<std::uint16_t>(x, 0x7c00u);
    default:
      break;
  }
  TROUPE_FAIL("cpu all_finite: dtype ", dtype_name(x.type()), " not supported");
}

}  // namespace troupe::cpu
