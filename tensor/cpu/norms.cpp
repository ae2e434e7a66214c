// CPU backend: softmax, LayerNorm and RMSNorm over the last dimension, with backward passes.
//
// Rows are independent and split across threads. Row statistics (mean, variance, dot products)
// accumulate in double lanes; the per-element work stays in the tensor's type. Parameter
// gradients (dw, db) are sums over rows, computed before dx (so dx may alias dy or x) over column
// tiles owned by one thread each: the += needs no atomics and does not depend on thread count.
#include <cmath>

#include "tensor/backend.hpp"
#include "tensor/cpu/fast_math.hpp"
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

template <class F>
void for_rows(row_shape s, std::int64_t grain, F&& body) {
  parallel::parallel_for(0, s.rows, row_grain(s.cols, grain),
                         [&](std::int64_t lo, std::int64_t hi) {
                           for (std::int64_t r = lo; r < hi; ++r) body(r);
                         });
}

// Sum over i of f(i) for one row in double lanes.
template <class F>
double row_sum(std::int64_t cols, F&& f) {
  return lane_sum<double>(0, cols, [&](std::int64_t i) { return static_cast<double>(f(i)); });
}

}  // namespace

void softmax(const tensor& x, const tensor& y) {
  dispatch_float("softmax", x.type(), [&]<class T>(T) {
    const T* xp = in<T>(x);
    T* yp = out<T>(y);
    const row_shape s = rows_of(x);
    for_rows(s, exp_grain, [&](std::int64_t r) {
      const T* xr = xp + r * s.cols;
      T* yr = yp + r * s.cols;
      const T m = lane_max(xr, s.cols);
      // Float lanes for the exp sum: each lane adds at most 32 terms in float before moving
      // its total into double (see lane_sum).
      double total = lane_sum<T>(0, s.cols, [&](std::int64_t i) {
        T e = exp_fast(xr[i] - m);
        yr[i] = e;
        return e;
      });
      const T inv = static_cast<T>(1.0 / total);
      for (std::int64_t i = 0; i < s.cols; ++i) yr[i] *= inv;
    });
  });
}

// dx = y * (dy - sum(y * dy)).
void softmax_backward(const tensor& y, const tensor& dy, const tensor& dx) {
  dispatch_float("softmax_backward", y.type(), [&]<class T>(T) {
    const T* yp = in<T>(y);
    const T* gp = in<T>(dy);
    T* dp = out<T>(dx);
    const row_shape s = rows_of(y);
    for_rows(s, elem_grain, [&](std::int64_t r) {
      const T* yr = yp + r * s.cols;
      const T* gr = gp + r * s.cols;
      T* dr = dp + r * s.cols;
      const T dot = static_cast<T>(row_sum(s.cols, [&](std::int64_t i) {
        return static_cast<double>(yr[i]) * static_cast<double>(gr[i]);
      }));
      for (std::int64_t i = 0; i < s.cols; ++i) dr[i] = yr[i] * (gr[i] - dot);
    });
  });
}

// Two-pass statistics in double: mean, then the biased variance of (x - mean).
void layernorm(const tensor& x, const tensor& w, const tensor& b, const tensor& y,
               const tensor& mean, const tensor& rstd, double eps) {
  dispatch_float("layernorm", x.type(), [&]<class T>(T) {
    const T* xp = in<T>(x);
    const T* wp = in<T>(w);
    const T* bp = b.defined() ? in<T>(b) : nullptr;
    T* yp = out<T>(y);
    T* mp = out<T>(mean);
    T* rp = out<T>(rstd);
    const row_shape s = rows_of(x);
    for_rows(s, elem_grain, [&](std::int64_t r) {
      const T* xr = xp + r * s.cols;
      T* yr = yp + r * s.cols;
      const double mu = row_sum(s.cols, [&](std::int64_t i) { return xr[i]; }) / s.cols;
      const double var = row_sum(s.cols,
                                 [&](std::int64_t i) {
                                   double d = static_cast<double>(xr[i]) - mu;
                                   return d * d;
                                 }) /
                         s.cols;
      const T m = static_cast<T>(mu);
      const T rs = static_cast<T>(1.0 / std::sqrt(var + eps));
      mp[r] = m;
      rp[r] = rs;
      if (bp != nullptr) {
        for (std::int64_t i = 0; i < s.cols; ++i) yr[i] = (xr[i] - m) * rs * wp[i] + bp[i];
      } else {
        for (std::int64_t i = 0; i < s.cols; ++i) yr[i] = (xr[i] - m) * rs * wp[i];
      }
    });
  });
}

// With xhat = (x - mean) * rstd and g = dy * w:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  dw += sum_rows(dy * xhat),  db +=
//   sum_rows(dy).
// dw and db are computed first, so dx may alias dy or x.
void layernorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& mean,
                        const tensor& rstd, const tensor& dx, const tensor& dw, const tensor& db) {
  dispatch_float("layernorm_backward", x.type(), [&]<class T>(T) {
    const T* gp = in<T>(dy);
    const T* xp = in<T>(x);
    const T* wp = in<T>(w);
    const T* mp = in<T>(mean);
    const T* rp = in<T>(rstd);
    T* dxp = out<T>(dx);
    T* dwp = out<T>(dw);
    T* dbp = out<T>(db);
    const row_shape s = rows_of(x);
    for_column_tiles(s.rows, s.cols, [&](std::int64_t c0, std::int64_t c1) {
      double aw[max_col_tile] = {}, ab[max_col_tile] = {};
      const std::int64_t n = c1 - c0;
      for (std::int64_t r = 0; r < s.rows; ++r) {
        const T* gr = gp + r * s.cols + c0;
        const T* xr = xp + r * s.cols + c0;
        const T m = mp[r], rs = rp[r];
        for (std::int64_t i = 0; i < n; ++i) {
          aw[i] += static_cast<double>(gr[i] * ((xr[i] - m) * rs));
          ab[i] += static_cast<double>(gr[i]);
        }
      }
      for (std::int64_t i = 0; i < n; ++i) dwp[c0 + i] += static_cast<T>(aw[i]);
      if (dbp != nullptr)
        for (std::int64_t i = 0; i < n; ++i) dbp[c0 + i] += static_cast<T>(ab[i]);
    });
    for_rows(s, elem_grain, [&](std::int64_t r) {
      const T* gr = gp + r * s.cols;
      const T* xr = xp + r * s.cols;
      T* dr = dxp + r * s.cols;
      const T m = mp[r], rs = rp[r];
      const double mg = row_sum(s.cols, [&](std::int64_t i) { return gr[i] * wp[i]; }) / s.cols;
      const double mgx =
          row_sum(s.cols, [&](std::int64_t i) { return gr[i] * wp[i] * ((xr[i] - m) * rs); }) /
          s.cols;
      const T a = static_cast<T>(mg), c = static_cast<T>(mgx);
      for (std::int64_t i = 0; i < s.cols; ++i) {
        T xhat = (xr[i] - m) * rs;
        dr[i] = rs * (gr[i] * wp[i] - a - xhat * c);
      }
    });
  });
}

void rmsnorm(const tensor& x, const tensor& w, const tensor& y, const tensor& rstd, double eps) {
  dispatch_float("rmsnorm", x.type(), [&]<class T>(T) {
    const T* xp = in<T>(x);
    const T* wp = in<T>(w);
    T* yp = out<T>(y);
    T* rp = out<T>(rstd);
    const row_shape s = rows_of(x);
    for_rows(s, elem_grain, [&](std::int64_t r) {
      const T* xr = xp + r * s.cols;
      T* yr = yp + r * s.cols;
      const double ms = row_sum(s.cols,
                                [&](std::int64_t i) {
                                  double v = static_cast<double>(xr[i]);
                                  return v * v;
                                }) /
                        s.cols;
      const T rs = static_cast<T>(1.0 / std::sqrt(ms + eps));
      rp[r] = rs;
      for (std::int64_t i = 0; i < s.cols; ++i) yr[i] = xr[i] * rs * wp[i];
    });
  });
}

// With xhat = x * rstd and g = dy * w: dx = rstd * (g - xhat * mean(g * xhat)),
// dw += sum_rows(dy * xhat). dw is computed first, so dx may alias dy or x.
void rmsnorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& rstd,
                      const tensor& dx, const tensor& dw) {
  dispatch_float("rmsnorm_backward", x.type(), [&]<class T>(T) {
    const T* gp = in<T>(dy);
    const T* xp = in<T>(x);
    const T* wp = in<T>(w);
    const T* rp = in<T>(rstd);
    T* dxp = out<T>(dx);
    T* dwp = out<T>(dw);
    const row_shape s = rows_of(x);
    for_column_tiles(s.rows, s.cols, [&](std::int64_t c0, std::int64_t c1) {
      double aw[max_col_tile] = {};
      const std::int64_t n = c1 - c0;
      for (std::int64_t r = 0; r < s.rows; ++r) {
        const T* gr = gp + r * s.cols + c0;
        const T* xr = xp + r * s.cols + c0;
        const T rs = rp[r];
        for (std::int64_t i = 0; i < n; ++i) aw[i] += static_cast<double>(gr[i] * (xr[i] * rs));
      }
      for (std::int64_t i = 0; i < n; ++i) dwp[c0 + i] += static_cast<T>(aw[i]);
    });
    for_rows(s, elem_grain, [&](std::int64_t r) {
      const T* gr = gp + r * s.cols;
      const T* xr = xp + r * s.cols;
      T* dr = dxp + r * s.cols;
      const T rs = rp[r];
      const T c = static_cast<T>(
          row_sum(s.cols, [&](std::int64_t i) { return gr[i] * wp[i] * (xr[i] * rs); }) / s.cols);
      for (std::int64_t i = 0; i < s.cols; ++i) dr[i] = rs * (gr[i] * wp[i] - xr[i] * rs * c);
    });
  });
}

}  // namespace troupe::cpu
