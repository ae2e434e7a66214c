// Tests of the CPU softmax, LayerNorm and RMSNorm kernels (forward and backward) against
// double-precision loops. Backward passes are checked against the analytic formulas; the
// layer-level finite-difference checks live with the layers.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "tensor/cpu/testing.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::cpu::testing;

namespace {

struct dims {
  std::int64_t rows, cols;
};
const dims row_shapes[] = {{3, 50257}, {7, 1}, {64, 1000}, {1, 7}, {10, 768}};

}  // namespace

// Error bounds. A sum of n terms in any order errs by at most n * u times the sum of the
// magnitudes of its terms (u its type's unit roundoff), so sum_err holds however the kernels group
// a row into lanes or threads. Row statistics are sums in double (kernel_util.hpp's lane_sum). The
// softmax of f32 adds its exps in float lanes of at most 32 terms (a fixed structure of lane_sum,
// not of the CPU) before the lane totals move to double: 32 * 2^-24 relative (all terms are
// positive), plus the double sum. The references sum in long double: their own error is negligible.
inline double sum_err(std::int64_t terms) {
  return double(terms) * 0x1p-53;
}
template <class T>
double softmax_sum_err(std::int64_t cols) {
  return (std::is_same_v<T, float> ? 32 * eps_of<float> : 0.0) + sum_err(cols);
}

TEMPLATE_TEST_CASE("softmax and its backward match a double loop", "[cpu]", float, double) {
  using T = TestType;
  const double e = eps_of<T>;
  rng g(21);
  for (auto [rows, cols] : row_shapes) {
    buffer<T> x({rows, cols}), y({rows, cols}), dy({rows, cols}), dx({rows, cols});
    fill_uniform(x, g, -10, 10);
    fill_uniform(dy, g, -1, 1);
    if (cols > 1) x[cols - 1] = -std::numeric_limits<T>::infinity();  // a masked entry
    std::vector<double> ref(rows * cols), bound(rows * cols), dref(rows * cols),
        dbound(rows * cols);
    for (std::int64_t r = 0; r < rows; ++r) {
      double m = -INFINITY;
      long double s = 0;
      for (std::int64_t c = 0; c < cols; ++c) m = std::max(m, double(x[r * cols + c]));
      for (std::int64_t c = 0; c < cols; ++c) s += std::exp((long double)x[r * cols + c] - m);
      for (std::int64_t c = 0; c < cols; ++c) {
        const double d = double(x[r * cols + c]) - m;
        ref[r * cols + c] = double(std::exp((long double)d) / s);
        // x - max rounds in T (relative error e * |d| after the exp), the exp and the scaling
        // round a few times, and the sum errs as above.
        bound[r * cols + c] =
            std::isinf(d) ? 0.0
                          : ref[r * cols + c] * (e * (std::fabs(d) + 8) + softmax_sum_err<T>(cols));
      }
    }
    ops::softmax(x, y);
    require_within(y, ref, bound);

    // Backward from the kernel's y: dot = sum(y * dy) in double lanes, then dx = y * (dy - dot)
    // with two roundings in T.
    for (std::int64_t r = 0; r < rows; ++r) {
      long double dot = 0, mag = 0;
      for (std::int64_t c = 0; c < cols; ++c) {
        dot += (long double)y[r * cols + c] * dy[r * cols + c];
        mag += std::fabs((long double)y[r * cols + c] * dy[r * cols + c]);
      }
      for (std::int64_t c = 0; c < cols; ++c) {
        const double yi = y[r * cols + c], gi = dy[r * cols + c];
        dref[r * cols + c] = yi * (gi - double(dot));
        dbound[r * cols + c] = std::fabs(yi) * (4 * e * (std::fabs(gi) + std::fabs(double(dot))) +
                                                sum_err(cols) * double(mag));
      }
    }
    ops::softmax_backward(y, dy, dx);
    require_within(dx, dref, dbound);

    // In place: y aliases x.
    ops::softmax(x, x);
    require_within(x, ref, bound);
  }
}

TEMPLATE_TEST_CASE("layernorm and its backward match a double loop", "[cpu]", float, double) {
  using T = TestType;
  const double e = eps_of<T>;
  const double eps = 1e-5;
  rng g(22);
  for (auto [rows, cols] : row_shapes) {
    const double se = sum_err(cols);
    for (bool with_bias : {true, false}) {
      // x is [2, rows, cols]: all leading dimensions are rows.
      const std::int64_t n = 2 * rows;
      buffer<T> x({2, rows, cols}), y({2, rows, cols}), w({cols}), b({cols}), mean({n}), rstd({n});
      buffer<T> dy({2, rows, cols}), dx({2, rows, cols}), dw({cols}), db({cols});
      fill_uniform(x, g, 1, 5);  // a mean far from 0 tests the two-pass variance
      fill_uniform(w, g, -1.5, 1.5);
      fill_uniform(b, g, -1, 1);
      fill_uniform(dy, g, -1, 1);
      fill_uniform(dw, g, -1, 1);
      fill_uniform(db, g, -1, 1);
      const tensor bias = with_bias ? b.t : tensor();
      const tensor dbias = with_bias ? db.t : tensor();

      std::vector<double> mu(n), rs(n), mu_tol(n), yref(n * cols), ybound(n * cols);
      for (std::int64_t r = 0; r < n; ++r) {
        const T* xr = &x.v[r * cols];
        long double s = 0, q = 0;
        for (std::int64_t c = 0; c < cols; ++c) s += xr[c];
        const long double m = s / cols;  // x > 0, so sum |x| = sum x
        for (std::int64_t c = 0; c < cols; ++c) q += (xr[c] - m) * (xr[c] - m);
        mu[r] = double(m);
        rs[r] = double(1 / std::sqrt(q / cols + eps));
        // Mean: the lane sum and the rounding to T. rstd: the variance sum (positive terms), the
        // square root, the division and the rounding to T.
        const double dmu = (se + e) * std::fabs(mu[r]);
        for (std::int64_t c = 0; c < cols; ++c) {
          const double xc = (xr[c] - mu[r]) * rs[r];
          yref[r * cols + c] = xc * double(w[c]) + (with_bias ? double(b[c]) : 0.0);
          ybound[r * cols + c] =
              std::fabs(double(w[c])) * rs[r] * (dmu + std::fabs(xr[c] - mu[r]) * (se + 6 * e)) +
              2 * e * (std::fabs(yref[r * cols + c]) + std::fabs(double(b[c])));
        }
      }
      ops::layernorm(x, w, bias, y, mean, rstd, eps);
      require_close(mean, mu, se + e, 0);
      require_close(rstd, rs, se + 4 * e, 0);
      require_within(y, yref, ybound);

      // Backward from the saved statistics (the values the forward stored). With g = dy * w:
      // xhat and g round in T (2e |xhat|, e |g|); the row means err by (4e + se) times the mean
      // magnitude of their terms; the final combination rounds a few more times.
      std::vector<double> dxref(n * cols), dxbound(n * cols);
      std::vector<double> dwref(cols), dwbound(cols), dbref(cols), dbbound(cols);
      for (std::int64_t c = 0; c < cols; ++c) {
        dwref[c] = dw[c];
        dbref[c] = db[c];
        dwbound[c] = 2 * e * std::fabs(dwref[c]);
        dbbound[c] = 2 * e * std::fabs(dbref[c]);
      }
      for (std::int64_t r = 0; r < n; ++r) {
        const double m = mean[r], s = rstd[r];
        long double mg = 0, mgx = 0, ag = 0, agx = 0;
        for (std::int64_t c = 0; c < cols; ++c) {
          const double xhat = (double(x[r * cols + c]) - m) * s;
          const double gi = double(dy[r * cols + c]) * double(w[c]);
          mg += gi;
          mgx += gi * xhat;
          ag += std::fabs(gi);
          agx += std::fabs(gi * xhat);
          dwref[c] += double(dy[r * cols + c]) * xhat;
          dwbound[c] += (4 * e + n * 0x1p-53) * std::fabs(dy[r * cols + c] * xhat);
          dbref[c] += dy[r * cols + c];
          dbbound[c] += (2 * e + n * 0x1p-53) * std::fabs(dy[r * cols + c]);
        }
        mg /= cols;
        mgx /= cols;
        ag /= cols;
        agx /= cols;
        for (std::int64_t c = 0; c < cols; ++c) {
          const double xhat = (double(x[r * cols + c]) - m) * s;
          const double gi = double(dy[r * cols + c]) * double(w[c]);
          dxref[r * cols + c] = s * (gi - double(mg) - xhat * double(mgx));
          dxbound[r * cols + c] =
              8 * (e + se) * s * (std::fabs(gi) + double(ag) + std::fabs(xhat) * double(agx));
        }
      }
      ops::layernorm_backward(dy, x, w, mean, rstd, dx, dw, dbias);
      require_within(dx, dxref, dxbound);
      require_within(dw, dwref, dwbound);  // accumulated onto the old values
      if (with_bias) require_within(db, dbref, dbbound);

      // dx may alias dy.
      buffer<T> dw2({cols});
      ops::layernorm_backward(dy, x, w, mean, rstd, dy, dw2, tensor());
      require_within(dy, dxref, dxbound);
    }
  }
}

TEMPLATE_TEST_CASE("rmsnorm and its backward match a double loop", "[cpu]", float, double) {
  using T = TestType;
  const double e = eps_of<T>;
  const double eps = 1e-6;
  rng g(23);
  for (auto [n, cols] : row_shapes) {
    const double se = sum_err(cols);
    buffer<T> x({n, cols}), y({n, cols}), w({cols}), rstd({n});
    buffer<T> dy({n, cols}), dx({n, cols}), dw({cols});
    fill_uniform(x, g, -3, 3);
    fill_uniform(w, g, -1.5, 1.5);
    fill_uniform(dy, g, -1, 1);
    fill_uniform(dw, g, -1, 1);
    std::vector<double> rs(n), yref(n * cols), ybound(n * cols);
    for (std::int64_t r = 0; r < n; ++r) {
      long double q = 0;
      for (std::int64_t c = 0; c < cols; ++c) q += (long double)x[r * cols + c] * x[r * cols + c];
      rs[r] = double(1 / std::sqrt(q / cols + eps));
      for (std::int64_t c = 0; c < cols; ++c) {
        yref[r * cols + c] = double(x[r * cols + c]) * rs[r] * double(w[c]);
        ybound[r * cols + c] = (se + 6 * e) * std::fabs(yref[r * cols + c]);
      }
    }
    ops::rmsnorm(x, w, y, rstd, eps);
    require_close(rstd, rs, se + 4 * e, 0);
    require_within(y, yref, ybound);

    std::vector<double> dxref(n * cols), dxbound(n * cols), dwref(cols), dwbound(cols);
    for (std::int64_t c = 0; c < cols; ++c) {
      dwref[c] = dw[c];
      dwbound[c] = 2 * e * std::fabs(dwref[c]);
    }
    for (std::int64_t r = 0; r < n; ++r) {
      const double s = rstd[r];
      long double mgx = 0, agx = 0;
      for (std::int64_t c = 0; c < cols; ++c) {
        const double xhat = double(x[r * cols + c]) * s;
        const double gx = double(dy[r * cols + c]) * double(w[c]) * xhat;
        mgx += gx;
        agx += std::fabs(gx);
        dwref[c] += double(dy[r * cols + c]) * xhat;
        dwbound[c] += (4 * e + n * 0x1p-53) * std::fabs(double(dy[r * cols + c]) * xhat);
      }
      mgx /= cols;
      agx /= cols;
      for (std::int64_t c = 0; c < cols; ++c) {
        const double xhat = double(x[r * cols + c]) * s;
        const double gi = double(dy[r * cols + c]) * double(w[c]);
        dxref[r * cols + c] = s * (gi - xhat * double(mgx));
        dxbound[r * cols + c] = 8 * (e + se) * s * (std::fabs(gi) + std::fabs(xhat) * double(agx));
      }
    }
    ops::rmsnorm_backward(dy, x, w, rstd, dx, dw);
    require_within(dx, dxref, dxbound);
    require_within(dw, dwref, dwbound);
  }
}

TEST_CASE("norms reject bad shapes and dtypes", "[cpu]") {
  buffer<float> x({4, 6}), y({4, 6}), w({6}), w5({5}), mean({4}), rstd({4}), rstd3({3});
  buffer<double> bd({6});
  REQUIRE_THROWS_WITH(ops::layernorm(x, w5, tensor(), y, mean, rstd, 1e-5),
                      Catch::Contains("layernorm: w must have shape [6]"));
  REQUIRE_THROWS_WITH(ops::layernorm(x, w, bd, y, mean, rstd, 1e-5),
                      Catch::Contains("layernorm: b has dtype f64"));
  REQUIRE_THROWS_WITH(ops::rmsnorm(x, w, y, rstd3, 1e-5),
                      Catch::Contains("rmsnorm: rstd must have shape [4]"));
  REQUIRE_THROWS_WITH(ops::rmsnorm(x, w, y, rstd, -1), Catch::Contains("eps must be >= 0"));
  REQUIRE_THROWS_WITH(ops::softmax(x, y.t.transpose(0, 1)), Catch::Contains("softmax: y"));
}
