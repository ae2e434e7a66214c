// Tests of the CPU fused softmax + cross-entropy against a double loop, including ignored rows and
// the in-place gradient (dlogits aliasing logits).
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "tensor/cpu/testing.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::cpu::testing;

namespace {

struct ce_ref {
  std::vector<double> loss, loss_bound, grad, grad_bound;
  std::int64_t counted = 0;
};

// losses and dlogits in double (sums in long double), with bounds for a kernel computing in T:
// exp of x - max has a relative error ~ e * |x - max| from the rounded difference, and the sum of
// exps errs relatively by v * 2^-53 in double (any order) plus, for f32, 32 e for the float lanes
// of at most 32 terms (kernel_util.hpp's lane_sum, the same on every CPU); the rest adds a few
// roundings.
template <class T, class I>
ce_ref reference(const buffer<T>& x, const buffer<I>& tgt, std::int64_t v, double scale,
                 std::int64_t ignore) {
  const std::int64_t n = tgt.size();
  const double e = eps_of<T>;
  const double se = (std::is_same_v<T, float> ? 32 * e : 0.0) + double(v) * 0x1p-53;
  ce_ref r;
  r.loss.resize(n);
  r.loss_bound.resize(n);
  r.grad.resize(n * v);
  r.grad_bound.resize(n * v);
  for (std::int64_t row = 0; row < n; ++row) {
    const std::int64_t t = tgt[row];
    if (t == ignore) continue;  // loss 0, gradient 0, bounds 0
    ++r.counted;
    double m = -INFINITY, big = 0;
    long double s = 0;
    for (std::int64_t i = 0; i < v; ++i) m = std::max(m, double(x[row * v + i]));
    for (std::int64_t i = 0; i < v; ++i) {
      s += std::exp((long double)x[row * v + i] - m);
      big = std::max(big, std::fabs(double(x[row * v + i]) - m));
    }
    const double lse = double(m + std::log(s));
    r.loss[row] = lse - double(x[row * v + t]);
    r.loss_bound[row] = 8 * e * (std::fabs(m) + std::fabs(lse) + big + 1) + se;
    for (std::int64_t i = 0; i < v; ++i) {
      const double d = double(x[row * v + i]) - m;
      const double p = double(std::exp((long double)d) / s);
      r.grad[row * v + i] = (p - (i == t ? 1.0 : 0.0)) * scale;
      r.grad_bound[row * v + i] =
          std::fabs(scale) * (p * (e * (std::fabs(d) + 8) + se) + (i == t ? 2 * e : 0));
    }
  }
  return r;
}

}  // namespace

TEMPLATE_TEST_CASE("cross_entropy matches a double loop with ignored rows", "[cpu]", float,
                   double) {
  using T = TestType;
  rng g(51);
  for (auto [n, v] :
       {std::pair<std::int64_t, std::int64_t>{3, 50257}, {64, 1000}, {10, 7}, {2, 1}}) {
    buffer<T> logits({n, v}), losses({n}), dlogits({n, v});
    fill_uniform(logits, g, -8, 8);
    logits[v / 2] = T(60);  // a dominant logit in row 0
    buffer<std::int64_t> tgt({n});
    for (std::int64_t r = 0; r < n; ++r) tgt[r] = g.integer(0, v - 1);
    if (n > 2) tgt[1] = -100;  // ignored
    const double scale = 1.0 / double(n);

    const ce_ref ref = reference(logits, tgt, v, scale, -100);
    const std::int64_t counted = ops::cross_entropy(logits, tgt, losses, dlogits, scale);
    REQUIRE(counted == ref.counted);
    require_within(losses, ref.loss, ref.loss_bound);
    require_within(dlogits, ref.grad, ref.grad_bound);

    // Without dlogits only the losses are written.
    buffer<T> losses2({n});
    REQUIRE(ops::cross_entropy(logits, tgt, losses2, tensor(), scale) == counted);
    require_within(losses2, ref.loss, ref.loss_bound);

    // dlogits may alias logits.
    buffer<T> inplace({n, v});
    ops::copy(logits, inplace);
    REQUIRE(ops::cross_entropy(inplace, tgt, losses2, inplace, scale) == counted);
    require_within(losses2, ref.loss, ref.loss_bound);
    require_within(inplace, ref.grad, ref.grad_bound);
  }
}

TEST_CASE("cross_entropy takes i32 targets and any ignore_index", "[cpu]") {
  rng g(52);
  const std::int64_t n = 6, v = 11;
  buffer<double> logits({2, 3, v}), losses({n}), dlogits({2, 3, v});  // rows are B * T
  fill_uniform(logits, g, -3, 3);
  buffer<std::int32_t> tgt({2, 3});
  for (std::int64_t r = 0; r < n; ++r) tgt[r] = std::int32_t(r % 5);
  // ignore_index = 3: rows whose target is 3 are ignored, and -100 is now an error.
  const ce_ref ref = reference(logits, tgt, v, 2.0, 3);
  REQUIRE(ops::cross_entropy(logits, tgt, losses, dlogits, 2.0, 3) == n - 1);
  require_within(losses, ref.loss, ref.loss_bound);
  require_within(dlogits, ref.grad, ref.grad_bound);
  tgt[4] = -100;
  REQUIRE_THROWS_WITH(ops::cross_entropy(logits, tgt, losses, dlogits, 2.0, 3),
                      Catch::Contains("target -100 at row 4 is outside [0, 11)"));
}

TEST_CASE("cross_entropy rejects bad arguments", "[cpu]") {
  buffer<float> logits({4, 9}), losses({4}), losses3({3});
  buffer<std::int64_t> tgt({4});
  tgt[2] = 9;
  REQUIRE_THROWS_WITH(ops::cross_entropy(logits, tgt, losses, tensor(), 1.0),
                      Catch::Contains("target 9 at row 2 is outside [0, 9)"));
  tgt[2] = 0;
  REQUIRE_THROWS_WITH(ops::cross_entropy(logits, tgt, losses3, tensor(), 1.0),
                      Catch::Contains("losses must have shape [4]"));
  buffer<float> ftgt({4});
  REQUIRE_THROWS_WITH(ops::cross_entropy(logits, ftgt, losses, tensor(), 1.0),
                      Catch::Contains("targets must be i32 or i64"));
  buffer<double> dl({4, 9});
  REQUIRE_THROWS_WITH(ops::cross_entropy(logits, tgt, losses, dl, 1.0),
                      Catch::Contains("dlogits has dtype f64"));
}
