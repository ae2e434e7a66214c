// Tests of the CPU AdamW step against torch.optim.AdamW's update written out in double.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "tensor/cpu/testing.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::cpu::testing;

TEMPLATE_TEST_CASE("adamw follows torch AdamW over several steps", "[cpu]", float, double) {
  using T = TestType;
  rng g(61);
  for (std::int64_t n : {std::int64_t{1}, std::int64_t{7}, std::int64_t{100003}}) {
    buffer<T> p({n}), grad({n}), m({n}), v({n});
    fill_uniform(p, g, -1, 1);
    std::vector<double> pr(n), mr(n), vr(n);
    for (std::int64_t i = 0; i < n; ++i) pr[i] = p[i];
    ops::adamw_options opt;
    opt.lr = 3e-3;
    opt.weight_decay = 0.1;
    opt.beta2 = 0.95;
    for (std::int64_t step = 1; step <= 5; ++step) {
      fill_uniform(grad, g, -1, 1);
      if (step == 3) grad[0] = T(0);  // m and v decay without input
      opt.step = step;
      ops::adamw(p, grad, m, v, opt);
      const double bc1 = 1 - std::pow(opt.beta1, double(step));
      const double bc2 = 1 - std::pow(opt.beta2, double(step));
      for (std::int64_t i = 0; i < n; ++i) {
        const double gi = grad[i];
        pr[i] *= 1 - opt.lr * opt.weight_decay;
        mr[i] = opt.beta1 * mr[i] + (1 - opt.beta1) * gi;
        vr[i] = opt.beta2 * vr[i] + (1 - opt.beta2) * gi * gi;
        pr[i] -= opt.lr / bc1 * mr[i] / (std::sqrt(vr[i] / bc2) + opt.eps);
      }
    }
    // Each step rounds a handful of operations in T; m and v are O(1) and the update O(lr).
    require_close(m, mr, 32 * eps_of<T>, 32 * eps_of<T>);
    require_close(v, vr, 32 * eps_of<T>, 32 * eps_of<T>);
    require_close(p, pr, 32 * eps_of<T>, 32 * eps_of<T>);
  }
}

TEST_CASE("adamw rejects bad options", "[cpu]") {
  buffer<float> p({5}), g({5}), m({5}), v({5}), v4({4});
  ops::adamw_options opt;
  opt.step = 0;
  REQUIRE_THROWS_WITH(ops::adamw(p, g, m, v, opt), Catch::Contains("step must be >= 1"));
  opt.step = 1;
  opt.beta2 = 1.0;
  REQUIRE_THROWS_WITH(ops::adamw(p, g, m, v, opt), Catch::Contains("betas must be in [0, 1)"));
  opt.beta2 = 0.999;
  REQUIRE_THROWS_WITH(ops::adamw(p, g, m, v4, opt), Catch::Contains("adamw: v has shape [4]"));
}
