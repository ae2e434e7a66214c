// Tests of the CPU GELU, SiLU and SwiGLU kernels against double-precision formulas.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "tensor/cpu/testing.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::cpu::testing;

namespace {

// The textbook forms, evaluated in double (tanh form for GELU, as HF gelu_new writes it).
constexpr double k0 = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double k1 = 0.044715;
double gelu_ref(double x) {
  return 0.5 * x * (1 + std::tanh(k0 * (x + k1 * x * x * x)));
}
double gelu_grad_ref(double x) {
  double t = std::tanh(k0 * (x + k1 * x * x * x));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k0 * (1 + 3 * k1 * x * x);
}
double sig(double x) {
  return 1 / (1 + std::exp(-x));
}
double silu_ref(double x) {
  return x * sig(x);
}
double silu_grad_ref(double x) {
  return sig(x) + x * sig(x) * (1 - sig(x));
}

const std::int64_t sizes[] = {1, 7, 1000003};

}  // namespace

// Tolerances: the kernels evaluate a few operations and one exp in T, so the error is a small
// multiple of T's unit roundoff relative to the magnitudes involved; atol covers zeros of the
// functions (GELU's derivative vanishes near x = -0.75), where relative error is meaningless.
TEMPLATE_TEST_CASE("gelu and its backward match the tanh formula", "[cpu]", float, double) {
  using T = TestType;
  rng g(11);
  const double tol = 64 * eps_of<T>;
  for (std::int64_t n : sizes) {
    buffer<T> x({n}), dy({n}), y({n}), dx({n});
    fill_uniform(x, g, -8, 8);
    fill_uniform(dy, g, -1, 1);
    x[0] = T(0);
    std::vector<double> ref(n), dref(n);
    for (std::int64_t i = 0; i < n; ++i) {
      ref[i] = gelu_ref(x[i]);
      dref[i] = double(dy[i]) * gelu_grad_ref(x[i]);
    }
    ops::gelu(x, y);
    require_close(y, ref, tol, tol);
    ops::gelu_backward(x, dy, dx);
    require_close(dx, dref, tol, tol);
  }
  SECTION("with saturated inputs") {
    buffer<T> x({4}), y({4});
    x[0] = T(-100);
    x[1] = T(100);
    x[2] = T(-1e4);
    x[3] = T(1e4);
    ops::gelu(x, y);
    REQUIRE(std::fabs(double(y[0])) < 1e-30);
    REQUIRE(y[1] == T(100));
    REQUIRE(y[2] == T(0));
    REQUIRE(y[3] == T(1e4));
  }
}

TEMPLATE_TEST_CASE("silu and swiglu and their backward match the formulas", "[cpu]", float,
                   double) {
  using T = TestType;
  rng g(12);
  const double tol = 64 * eps_of<T>;
  for (std::int64_t n : sizes) {
    buffer<T> x({n}), up({n}), dy({n}), y({n}), dx({n}), dup({n});
    fill_uniform(x, g, -10, 10);
    fill_uniform(up, g, -2, 2);
    fill_uniform(dy, g, -1, 1);
    std::vector<double> ref(n), dref(n), duref(n);

    for (std::int64_t i = 0; i < n; ++i) {
      ref[i] = silu_ref(x[i]);
      dref[i] = double(dy[i]) * silu_grad_ref(x[i]);
    }
    ops::silu(x, y);
    require_close(y, ref, tol, tol);
    ops::silu_backward(x, dy, dx);
    require_close(dx, dref, tol, tol);

    for (std::int64_t i = 0; i < n; ++i) {
      ref[i] = silu_ref(x[i]) * double(up[i]);
      dref[i] = double(dy[i]) * double(up[i]) * silu_grad_ref(x[i]);
      duref[i] = double(dy[i]) * silu_ref(x[i]);
    }
    ops::swiglu(x, up, y);
    require_close(y, ref, tol, tol);
    ops::swiglu_backward(x, up, dy, dx, dup);
    require_close(dx, dref, tol, tol);
    require_close(dup, duref, tol, tol);
  }
}

TEST_CASE("activations reject mismatched arguments", "[cpu]") {
  buffer<float> x({3, 4}), y({4, 3}), z({3, 4});
  buffer<double> d({3, 4});
  REQUIRE_THROWS_WITH(ops::gelu(x, y), Catch::Contains("gelu: y has shape [4, 3]"));
  REQUIRE_THROWS_WITH(ops::silu_backward(x, d, z),
                      Catch::Contains("silu_backward: dy has dtype f64"));
  buffer<float> wide({3, 8});
  REQUIRE_THROWS_WITH(ops::swiglu(x, z, wide.t.slice(1, 0, 8, 2)),
                      Catch::Contains("swiglu: out must be contiguous"));
}
