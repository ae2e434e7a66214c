// Tests of the bf16 and f16 paths of the CPU elementwise ops, reductions and activations: each
// against the f32 op run on the same rounded inputs (half_testing.hpp), and the vector converters
// of half.hpp (through ops::copy, whose contiguous runs use them) against the scalar ones of
// tensor/dtype.hpp.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "tensor/cpu/half_testing.hpp"
#include "tensor/ops.hpp"
#include "tensor/parallel.hpp"

using namespace troupe;
using namespace troupe::cpu::testing;

namespace {

// Sizes around the 256-element blocks and 8-wide vectors of the 16-bit paths, and one spanning
// several threads' chunks.
const std::int64_t sizes[] = {1, 7, 255, 257, 100003};

float float_of_bits(std::uint32_t u) {
  return std::bit_cast<float>(u);
}

}  // namespace

TEST_CASE("the vector converters round like the scalar ones", "[cpu]") {
  // Every 16-bit pattern widens exactly.
  buffer<bf16_t> all({65536});
  for (std::uint32_t i = 0; i < 65536; ++i) all[i].bits = static_cast<std::uint16_t>(i);
  buffer<float> wide({65536});
  ops::copy(all, wide);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const float want = bf16_bits_to_f32(all[i].bits);
    if (std::isnan(want)) {
      REQUIRE(std::isnan(wide[i]));
    } else {
      REQUIRE(std::bit_cast<std::uint32_t>(wide[i]) == std::bit_cast<std::uint32_t>(want));
    }
  }
  ops::copy(tensor(all.v.data(), 131072, dtype::f16, {65536}), wide);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const float want = f16_bits_to_f32(all[i].bits);
    if (std::isnan(want)) {
      REQUIRE(std::isnan(wide[i]));
    } else {
      REQUIRE(std::bit_cast<std::uint32_t>(wide[i]) == std::bit_cast<std::uint32_t>(want));
    }
  }
  // Floats near every rounding decision: random bit patterns, ties (the halfway bit set and
  // nothing below it), values at the f16 subnormal and overflow edges, infinities and NaN.
  rng g(1);
  std::vector<float> src;
  for (int i = 0; i < 200000; ++i) {
    src.push_back(float_of_bits(static_cast<std::uint32_t>(g.integer(0, 0xffffffffll))));
    const std::uint32_t hi = static_cast<std::uint32_t>(g.integer(0, 0xffff)) << 16;
    src.push_back(float_of_bits(hi | 0x8000u));  // a bf16 tie
    const std::uint32_t f16_exp = static_cast<std::uint32_t>(g.integer(100, 143)) << 23;
    src.push_back(float_of_bits(f16_exp | (static_cast<std::uint32_t>(g.integer(0, 1023)) << 13) |
                                0x1000u));  // an f16 tie (subnormal to overflow range)
  }
  for (float f : {0.0f, -0.0f, 65504.0f, 65520.0f, 65519.99f, 0x1p-24f, 0x1p-25f, 0x1.8p-25f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::max()})
    src.push_back(f);
  const std::int64_t n = static_cast<std::int64_t>(src.size());  // not a multiple of 8: a tail
  const tensor from(src.data(), src.size() * 4, dtype::f32, {n});
  buffer<bf16_t> b({n});
  buffer<f16_t> h({n});
  ops::copy(from, b);
  ops::copy(from, h);
  for (std::int64_t i = 0; i < n; ++i) {
    const float f = src[static_cast<std::size_t>(i)];
    INFO("f32 bits " << std::hex << std::bit_cast<std::uint32_t>(f));
    if (std::isnan(f)) {
      REQUIRE(std::isnan(bf16_bits_to_f32(b[i].bits)));
      REQUIRE(std::isnan(f16_bits_to_f32(h[i].bits)));
      continue;
    }
    REQUIRE(b[i].bits == f32_to_bf16_bits(f));
    REQUIRE(h[i].bits == f32_to_f16_bits(f));
  }
}

TEMPLATE_TEST_CASE("16-bit add mul axpy and scale round the f32 result once", "[cpu]", bf16_t,
                   f16_t) {
  using S = TestType;
  rng g(2);
  for (std::int64_t n : sizes) {
    twin<S> a({n}), b({n});
    a.uniform(g, -100, 100);
    b.uniform(g, -100, 100);
    buffer<S> out({n});
    buffer<float> ref({n});
    ops::add(a.h, b.h, out);
    ops::add(a.f, b.f, ref);
    require_ulps(out, ref, 0.5);
    ops::mul(a.h, b.h, out);
    ops::mul(a.f, b.f, ref);
    require_ulps(out, ref, 0.5);
    ops::add(a.h, b.h, a.h);  // out aliasing an input
    ops::add(a.f, b.f, a.f);
    require_ulps(a.h, a.f, 0.5);
    a.sync();
    ops::axpy(-0.3, a.h, b.h);  // y += alpha x with y read and written
    ops::axpy(-0.3, a.f, b.f);
    require_ulps(b.h, b.f, 0.5);
    b.sync();
    ops::scale(b.h, 1.7);
    ops::scale(b.f, 1.7);
    require_ulps(b.h, b.f, 0.5);
  }
}

TEMPLATE_TEST_CASE("16-bit add_bias and sum_rows match the f32 ops", "[cpu]", bf16_t, f16_t) {
  using S = TestType;
  rng g(3);
  struct dims {
    std::int64_t rows, cols;
  };
  for (auto [rows, cols] : {dims{3, 5}, dims{64, 300}, dims{1000, 768}, dims{5, 1}}) {
    twin<S> x({rows, cols}), bias({cols}), acc({cols});
    x.uniform(g, -4, 4);
    bias.uniform(g, -4, 4);
    acc.uniform(g, -1, 1);  // sum_rows adds to what is there
    ops::add_bias(x.h, bias.h);
    ops::add_bias(x.f, bias.f);
    require_ulps(x.h, x.f, 0.5);
    x.sync();
    ops::sum_rows(x.h, acc.h);
    ops::sum_rows(x.f, acc.f);
    // Both sum in double and add the rounded sum to the old value in f32; the 16-bit result is
    // that f32 value rounded once.
    require_ulps(acc.h, acc.f, 0.5);
  }
}

TEMPLATE_TEST_CASE("16-bit sum and sum_squares equal the f32 ones on the same values", "[cpu]",
                   bf16_t, f16_t) {
  using S = TestType;
  rng g(4);
  for (std::int64_t n : sizes) {
    twin<S> x({n});
    x.uniform(g, -3, 5);
    // Both accumulate the same values in double (in different groupings); squares of 16-bit and
    // f32 values are exact in double. A double sum of n terms in any order is within
    // n * 2^-53 * sum |terms| of the exact sum (long double here, 2^11 times finer), so the two
    // differ by at most twice that.
    long double exact = 0, exact2 = 0, mag = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const long double v = value_of(x.h[i]);
      exact += v;
      exact2 += v * v;
      mag += std::fabs(v);
    }
    const double b = static_cast<double>(n) * 0x1p-53 * static_cast<double>(mag);
    const double b2 = static_cast<double>(n) * 0x1p-53 * static_cast<double>(exact2);
    CHECK(std::fabs(ops::sum(x.h) - ops::sum(x.f)) <= 2 * b);
    CHECK(std::fabs(ops::sum_squares(x.h) - ops::sum_squares(x.f)) <= 2 * b2);
    CHECK(std::fabs(ops::sum(x.h) - static_cast<double>(exact)) <= b);
    CHECK(std::fabs(ops::sum_squares(x.h) - static_cast<double>(exact2)) <= b2);
  }
}

TEMPLATE_TEST_CASE("16-bit activations and their backwards round the f32 results once", "[cpu]",
                   bf16_t, f16_t) {
  using S = TestType;
  rng g(5);
  for (std::int64_t n : sizes) {
    twin<S> x({n}), u({n}), dy({n});
    x.uniform(g, -8, 8);
    u.uniform(g, -3, 3);
    dy.uniform(g, -2, 2);
    buffer<S> y({n}), y2({n});
    buffer<float> r({n}), r2({n});
    ops::gelu(x.h, y);
    ops::gelu(x.f, r);
    require_ulps(y, r, 0.5);
    ops::gelu_backward(x.h, dy.h, y);
    ops::gelu_backward(x.f, dy.f, r);
    require_ulps(y, r, 0.5);
    ops::silu(x.h, y);
    ops::silu(x.f, r);
    require_ulps(y, r, 0.5);
    ops::silu_backward(x.h, dy.h, y);
    ops::silu_backward(x.f, dy.f, r);
    require_ulps(y, r, 0.5);
    ops::swiglu(x.h, u.h, y);
    ops::swiglu(x.f, u.f, r);
    require_ulps(y, r, 0.5);
    ops::swiglu_backward(x.h, u.h, dy.h, y, y2);
    ops::swiglu_backward(x.f, u.f, dy.f, r, r2);
    require_ulps(y, r, 0.5);
    require_ulps(y2, r2, 0.5);
    // In place: dgate over gate and dup over up.
    ops::swiglu_backward(x.h, u.h, dy.h, x.h, u.h);
    require_same_bits(x.h, y);
    require_same_bits(u.h, y2);
  }
}

TEMPLATE_TEST_CASE("16-bit elementwise results are independent of the thread count", "[cpu]",
                   bf16_t, f16_t) {
  using S = TestType;
  rng g(6);
  const std::int64_t n = 300007;
  twin<S> x({n});
  x.uniform(g, -2, 2);
  buffer<S> y1({n}), y2({n});
  const int threads = parallel::num_threads();
  parallel::set_num_threads(1);
  ops::gelu(x.h, y1);
  const double s1 = ops::sum_squares(x.h);
  parallel::set_num_threads(std::max(threads, 2));
  ops::gelu(x.h, y2);
  const double s2 = ops::sum_squares(x.h);
  parallel::set_num_threads(threads);
  require_same_bits(y1, y2);
  CHECK(s1 == s2);
}
