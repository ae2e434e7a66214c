// CPU backend: softmax, LayerNorm and RMSNorm over the last dimension, with backward passes.
//
// Rows are independent and split across threads. Row statistics (mean, variance, dot products)
// accumulate in double lanes; the per-element work runs in the compute type C (the tensor's type
// for f32 and f64; f32 for bf16 and f16, whose rows are widened into per-thread scratch, computed
// by the same row functions and rounded once on the way out). Parameter gradients (dw, db) are sums
// over rows, computed before dx (so dx may alias dy or x) over column tiles owned by one thread
// each: the += needs no atomics and does not depend on thread count. Saved statistics (mean, rstd)
// are stored in the dtype of x, or in f32 for 16-bit x (St below).
#include <cmath>

#include "tensor/backend.hpp"
#include "tensor/cpu/fast_math.hpp"
#include "tensor/cpu/half.hpp"
#include "tensor/cpu/kernel_util.hpp"
#include "tensor/parallel.hpp"

namespace troupe::cpu {
namespace {

template <class T>
const T* in(const tensor& t) {
  return static_cast<const T*>(t.data());
}
template <class T>
T* out(const tensor& t) {
  return t.defined() ? static_cast<T*>(t.data()) : nullptr;
}

struct row_shape {
  std::int64_t rows, cols;
};
row_shape rows_of(const tensor& x) {
  std::int64_t c = x.dim() == 0 ? 1 : x.size(-1);
  return {c == 0 ? 0 : x.numel() / c, c};
}

// body(lo, hi) on chunks of rows.
template <class F>
void for_row_chunks(row_shape s, std::int64_t grain, F&& body) {
  parallel::parallel_for(0, s.rows, row_grain(s.cols, grain), body);
}

// Sum over i of f(i) for one row in double lanes.
template <class F>
double row_sum(std::int64_t cols, F&& f) {
  return lane_sum<double>(0, cols, [&](std::int64_t i) { return static_cast<double>(f(i)); });
}

// Calls f(St{}) with St the storage type of the saved statistics: S itself, or float when S is
// 16-bit and the statistics tensor is f32 (ops.cpp allows nothing else).
template <class S, class F>
void dispatch_stats(const tensor& stat, F&& f) {
  if constexpr (is_half<S>) {
    if (stat.type() == dtype::f32) return f(float{});
  }
  f(S{});
}

// The rows [lo, hi) of a row-wise op in the compute type: for f32 and f64 the tensor's own rows,
// for 16-bit ones f32 copies in the calling thread's scratch (laid out as the row inputs, the
// result row, then the vectors). The result goes to its own row so that the row functions see no
// aliasing (an in-place row would make GCC's vectorized loops fall back to scalar ones).
template <class S, int inputs>
struct row_io {
  using C = compute_t<S>;
  const S* src[inputs];
  S* dst;
  std::int64_t cols;
  C* scratch = nullptr;

  void begin(std::int64_t vectors = 0) {
    if constexpr (is_half<S>)
      scratch = thread_floats(static_cast<std::size_t>((inputs + 1 + vectors) * cols));
  }
  // A vector used by every row (a weight), in the compute type.
  const C* vector(int slot, const S* v) {
    if constexpr (is_half<S>) {
      C* d = scratch + (inputs + 1 + slot) * cols;
      widen_n(v, d, cols);
      return d;
    } else {
      return v;
    }
  }
  const C* row(int k, std::int64_t r) {
    if constexpr (is_half<S>) {
      widen_n(src[k] + r * cols, scratch + k * cols, cols);
      return scratch + k * cols;
    } else {
      return src[k] + r * cols;
    }
  }
  // Where row r's result goes; finish(r) stores it.
  C* result(std::int64_t r) {
    if constexpr (is_half<S>) {
      return scratch + inputs * cols;
    } else {
      return dst + r * cols;
    }
  }
  void finish(std::int64_t r) {
    if constexpr (is_half<S>) narrow_n(scratch + inputs * cols, dst + r * cols, cols);
  }
};

// ---- row functions (C = float or double) -------------------------------------------------------

template <class C>
void softmax_row(const C* xr, C* yr, std::int64_t cols) {
  const C m = lane_max(xr, cols);
  // Float lanes for the exp sum: each lane adds at most 32 terms in float before moving its
  // total into double (see lane_sum).
  double total = lane_sum<C>(0, cols, [&](std::int64_t i) {
    C e = exp_fast(xr[i] - m);
    yr[i] = e;
    return e;
  });
  const C inv = static_cast<C>(1.0 / total);
  for (std::int64_t i = 0; i < cols; ++i) yr[i] *= inv;
}

template <class C>
void softmax_backward_row(const C* yr, const C* gr, C* dr, std::int64_t cols) {
  const C dot = static_cast<C>(row_sum(cols, [&](std::int64_t i) {
    return static_cast<double>(yr[i]) * static_cast<double>(gr[i]);
  }));
  for (std::int64_t i = 0; i < cols; ++i) dr[i] = yr[i] * (gr[i] - dot);
}

template <class C>
struct row_stats {
  C mean, rstd;
};

// Two-pass statistics in double: mean, then the biased variance of (x - mean). bp may be null.
template <class C>
[[gnu::always_inline]] inline row_stats<C> layernorm_row(const C* xr, const C* wp, const C* bp,
                                                         C* yr, std::int64_t cols, double eps) {
  const double mu = row_sum(cols, [&](std::int64_t i) { return xr[i]; }) / cols;
  const double var = row_sum(cols,
                             [&](std::int64_t i) {
                               double d = static_cast<double>(xr[i]) - mu;
                               return d * d;
                             }) /
                     cols;
  const C m = static_cast<C>(mu);
  const C rs = static_cast<C>(1.0 / std::sqrt(var + eps));
  if (bp != nullptr) {
    for (std::int64_t i = 0; i < cols; ++i) yr[i] = (xr[i] - m) * rs * wp[i] + bp[i];
  } else {
    for (std::int64_t i = 0; i < cols; ++i) yr[i] = (xr[i] - m) * rs * wp[i];
  }
  return {m, rs};
}

template <class C>
void layernorm_dx_row(const C* gr, const C* xr, const C* wp, C* dr, std::int64_t cols, C m, C rs) {
  const double mg = row_sum(cols, [&](std::int64_t i) { return gr[i] * wp[i]; }) / cols;
  const double mgx =
      row_sum(cols, [&](std::int64_t i) { return gr[i] * wp[i] * ((xr[i] - m) * rs); }) / cols;
  const C a = static_cast<C>(mg), c = static_cast<C>(mgx);
  for (std::int64_t i = 0; i < cols; ++i) {
    C xhat = (xr[i] - m) * rs;
    dr[i] = rs * (gr[i] * wp[i] - a - xhat * c);
  }
}

template <class C>
C rmsnorm_row(const C* xr, const C* wp, C* yr, std::int64_t cols, double eps) {
  const double ms = row_sum(cols,
                            [&](std::int64_t i) {
                              double v = static_cast<double>(xr[i]);
                              return v * v;
                            }) /
                    cols;
  const C rs = static_cast<C>(1.0 / std::sqrt(ms + eps));
  for (std::int64_t i = 0; i < cols; ++i) yr[i] = xr[i] * rs * wp[i];
  return rs;
}

template <class C>
void rmsnorm_dx_row(const C* gr, const C* xr, const C* wp, C* dr, std::int64_t cols, C rs) {
  const C c = static_cast<C>(
      row_sum(cols, [&](std::int64_t i) { return gr[i] * wp[i] * (xr[i] * rs); }) / cols);
  for (std::int64_t i = 0; i < cols; ++i) dr[i] = rs * (gr[i] * wp[i] - xr[i] * rs * c);
}

// One row's contribution to the column sums of dw (and db, with_mean only): gr and xr are the
// row's tile of n columns in the compute type.
template <bool with_mean, class C>
inline void add_param_row(const C* gr, const C* xr, std::int64_t n, C m, C rs, double* aw,
                          double* ab) {
  if constexpr (with_mean) {
    for (std::int64_t i = 0; i < n; ++i) {
      aw[i] += static_cast<double>(gr[i] * ((xr[i] - m) * rs));
      ab[i] += static_cast<double>(gr[i]);
    }
  } else {
    for (std::int64_t i = 0; i < n; ++i) aw[i] += static_cast<double>(gr[i] * (xr[i] * rs));
  }
}

// dw += sum_rows(dy * xhat) and, with_mean (LayerNorm), db += sum_rows(dy) (db may be undefined),
// per column tile in double; without (RMSNorm) xhat = x * rstd. Each += forms the sum in C and
// rounds once.
template <class S, bool with_mean, class St>
void norm_param_grads(const tensor& dy, const tensor& x, const St* mp, const St* rp,
                      const tensor& dw, const tensor& db) {
  using C = compute_t<S>;
  const S* gp = in<S>(dy);
  const S* xp = in<S>(x);
  S* dwp = out<S>(dw);
  S* dbp = out<S>(db);
  const row_shape s = rows_of(x);
  for_column_tiles(s.rows, s.cols, [&](std::int64_t c0, std::int64_t c1) {
    double aw[max_col_tile] = {}, ab[max_col_tile] = {};
    const std::int64_t n = c1 - c0;
    for (std::int64_t r = 0; r < s.rows; ++r) {
      const C m = with_mean ? static_cast<C>(to_compute(mp[r])) : C(0);
      const C rs = static_cast<C>(to_compute(rp[r]));
      const S* gr = gp + r * s.cols + c0;
      const S* xr = xp + r * s.cols + c0;
      if constexpr (is_half<S>) {
        float gt[max_col_tile], xt[max_col_tile];
        widen_n(gr, gt, n);
        widen_n(xr, xt, n);
        add_param_row<with_mean>(gt, xt, n, m, rs, aw, ab);
      } else {
        add_param_row<with_mean>(gr, xr, n, m, rs, aw, ab);
      }
    }
    for (std::int64_t i = 0; i < n; ++i)
      dwp[c0 + i] = from_compute<S>(to_compute(dwp[c0 + i]) + static_cast<C>(aw[i]));
    if (with_mean && dbp != nullptr)
      for (std::int64_t i = 0; i < n; ++i)
        dbp[c0 + i] = from_compute<S>(to_compute(dbp[c0 + i]) + static_cast<C>(ab[i]));
  });
}

}  // namespace

void softmax(const tensor& x, const tensor& y) {
  dispatch_floating("softmax", x.type(), [&]<class S>(S) {
    const row_shape s = rows_of(x);
    for_row_chunks(s, exp_grain, [&](std::int64_t lo, std::int64_t hi) {
      row_io<S, 1> io{{in<S>(x)}, out<S>(y), s.cols};
      io.begin();
      for (std::int64_t r = lo; r < hi; ++r) {
        softmax_row(io.row(0, r), io.result(r), s.cols);
        io.finish(r);
      }
    });
  });
}

// dx = y * (dy - sum(y * dy)).
void softmax_backward(const tensor& y, const tensor& dy, const tensor& dx) {
  dispatch_floating("softmax_backward", y.type(), [&]<class S>(S) {
    const row_shape s = rows_of(y);
    for_row_chunks(s, elem_grain, [&](std::int64_t lo, std::int64_t hi) {
      row_io<S, 2> io{{in<S>(y), in<S>(dy)}, out<S>(dx), s.cols};
      io.begin();
      for (std::int64_t r = lo; r < hi; ++r) {
        const auto* yr = io.row(0, r);
        softmax_backward_row(yr, io.row(1, r), io.result(r), s.cols);
        io.finish(r);
      }
    });
  });
}

void layernorm(const tensor& x, const tensor& w, const tensor& b, const tensor& y,
               const tensor& mean, const tensor& rstd, double eps) {
  dispatch_floating("layernorm", x.type(), [&]<class S>(S) {
    dispatch_stats<S>(mean, [&]<class St>(St) {
      using C = compute_t<S>;
      St* mp = out<St>(mean);
      St* rp = out<St>(rstd);
      const row_shape s = rows_of(x);
      for_row_chunks(s, elem_grain, [&](std::int64_t lo, std::int64_t hi) {
        row_io<S, 1> io{{in<S>(x)}, out<S>(y), s.cols};
        io.begin(2);
        const C* wp = io.vector(0, in<S>(w));
        const C* bp = b.defined() ? io.vector(1, in<S>(b)) : nullptr;
        for (std::int64_t r = lo; r < hi; ++r) {
          const row_stats<C> st = layernorm_row(io.row(0, r), wp, bp, io.result(r), s.cols, eps);
          io.finish(r);
          mp[r] = from_compute<St>(st.mean);
          rp[r] = from_compute<St>(st.rstd);
        }
      });
    });
  });
}

// With xhat = (x - mean) * rstd and g = dy * w:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  dw += sum_rows(dy * xhat),  db +=
//   sum_rows(dy).
// dw and db are computed first, so dx may alias dy or x.
void layernorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& mean,
                        const tensor& rstd, const tensor& dx, const tensor& dw, const tensor& db) {
  dispatch_floating("layernorm_backward", x.type(), [&]<class S>(S) {
    dispatch_stats<S>(mean, [&]<class St>(St) {
      using C = compute_t<S>;
      const St* mp = in<St>(mean);
      const St* rp = in<St>(rstd);
      norm_param_grads<S, true>(dy, x, mp, rp, dw, db);
      const row_shape s = rows_of(x);
      for_row_chunks(s, elem_grain, [&](std::int64_t lo, std::int64_t hi) {
        row_io<S, 2> io{{in<S>(dy), in<S>(x)}, out<S>(dx), s.cols};
        io.begin(1);
        const C* wp = io.vector(0, in<S>(w));
        for (std::int64_t r = lo; r < hi; ++r) {
          const C* gr = io.row(0, r);
          const C* xr = io.row(1, r);
          layernorm_dx_row(gr, xr, wp, io.result(r), s.cols, static_cast<C>(to_compute(mp[r])),
                           static_cast<C>(to_compute(rp[r])));
          io.finish(r);
        }
      });
    });
  });
}

void rmsnorm(const tensor& x, const tensor& w, const tensor& y, const tensor& rstd, double eps) {
  dispatch_floating("rmsnorm", x.type(), [&]<class S>(S) {
    dispatch_stats<S>(rstd, [&]<class St>(St) {
      using C = compute_t<S>;
      St* rp = out<St>(rstd);
      const row_shape s = rows_of(x);
      for_row_chunks(s, elem_grain, [&](std::int64_t lo, std::int64_t hi) {
        row_io<S, 1> io{{in<S>(x)}, out<S>(y), s.cols};
        io.begin(1);
        const C* wp = io.vector(0, in<S>(w));
        for (std::int64_t r = lo; r < hi; ++r) {
          const C rs = rmsnorm_row(io.row(0, r), wp, io.result(r), s.cols, eps);
          io.finish(r);
          rp[r] = from_compute<St>(rs);
        }
      });
    });
  });
}

// With xhat = x * rstd and g = dy * w: dx = rstd * (g - xhat * mean(g * xhat)),
// dw += sum_rows(dy * xhat). dw is computed first, so dx may alias dy or x.
void rmsnorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& rstd,
                      const tensor& dx, const tensor& dw) {
  dispatch_floating("rmsnorm_backward", x.type(), [&]<class S>(S) {
    dispatch_stats<S>(rstd, [&]<class St>(St) {
      using C = compute_t<S>;
      const St* rp = in<St>(rstd);
      norm_param_grads<S, false>(dy, x, static_cast<const St*>(nullptr), rp, dw, tensor());
      const row_shape s = rows_of(x);
      for_row_chunks(s, elem_grain, [&](std::int64_t lo, std::int64_t hi) {
        row_io<S, 2> io{{in<S>(dy), in<S>(x)}, out<S>(dx), s.cols};
        io.begin(1);
        const C* wp = io.vector(0, in<S>(w));
        for (std::int64_t r = lo; r < hi; ++r) {
          const C* gr = io.row(0, r);
          const C* xr = io.row(1, r);
          rmsnorm_dx_row(gr, xr, wp, io.result(r), s.cols, static_cast<C>(to_compute(rp[r])));
          io.finish(r);
        }
      });
    });
  });
}

}  // namespace troupe::cpu
