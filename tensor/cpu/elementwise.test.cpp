// Tests of the CPU fill, copy, elementwise arithmetic and reductions against plain loops.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "memory/error.hpp"
#include "tensor/cpu/fast_math.hpp"
#include "tensor/cpu/testing.hpp"
#include "tensor/ops.hpp"
#include "tensor/parallel.hpp"

using namespace troupe;
using namespace troupe::cpu::testing;

namespace {

const std::int64_t sizes[] = {1, 7, 1000003};

// The element of a strided view at linear (row-major) index i, by plain stride arithmetic.
std::int64_t strided_offset(const tensor& t, std::int64_t i) {
  std::int64_t off = t.offset();
  for (int d = t.dim() - 1; d >= 0; --d) {
    off += (i % t.size(d)) * t.stride(d);
    i /= t.size(d);
  }
  return off;
}

}  // namespace

TEST_CASE("fill writes the value in every dtype", "[cpu]") {
  for (std::int64_t n : sizes) {
    buffer<float> f({n});
    ops::fill(f, 1.5);
    for (std::int64_t i = 0; i < n; ++i) REQUIRE(f[i] == 1.5f);
    buffer<double> d({n});
    ops::fill(d, -0.1);
    for (std::int64_t i = 0; i < n; ++i) REQUIRE(d[i] == -0.1);
  }
  buffer<bf16_t> b({9});
  ops::fill(b, 3.0);
  for (std::int64_t i = 0; i < 9; ++i) REQUIRE(b[i].bits == f32_to_bf16_bits(3.0f));
  buffer<f16_t> h({9});
  ops::fill(h, 0.1);
  for (std::int64_t i = 0; i < 9; ++i) REQUIRE(h[i].bits == f32_to_f16_bits(0.1f));
  buffer<std::int32_t> i32({5});
  ops::fill(i32, -7);
  for (std::int64_t i = 0; i < 5; ++i) REQUIRE(i32[i] == -7);
  buffer<std::int64_t> i64({5});
  ops::fill(i64, 1e12);
  for (std::int64_t i = 0; i < 5; ++i) REQUIRE(i64[i] == 1000000000000);
  buffer<std::uint8_t> u8({5});
  ops::fill(u8, 255);
  for (std::int64_t i = 0; i < 5; ++i) REQUIRE(u8[i] == 255);
  REQUIRE_THROWS_WITH(ops::fill(i32, 1.5), Catch::Contains("not representable as i32"));
  REQUIRE_THROWS_WITH(ops::fill(u8, 256), Catch::Contains("not representable as u8"));
}

TEST_CASE("copy converts between floating dtypes like the scalar converters", "[cpu]") {
  rng g(1);
  const std::int64_t n = 100003;
  buffer<float> src({n});
  for (std::int64_t i = 0; i < n; ++i) {
    // Wide exponents so that f16 sees subnormals and overflow.
    src[i] = static_cast<float>(g.uniform(-1, 1) * std::pow(2.0, g.uniform(-30, 20)));
  }
  src[0] = std::numeric_limits<float>::infinity();
  src[1] = -std::numeric_limits<float>::infinity();
  src[2] = std::numeric_limits<float>::quiet_NaN();
  src[3] = -0.0f;

  buffer<bf16_t> b({n});
  buffer<f16_t> h({n});
  buffer<double> d({n});
  ops::copy(src, b);
  ops::copy(src, h);
  ops::copy(src, d);
  for (std::int64_t i = 0; i < n; ++i) {
    REQUIRE(b[i].bits == f32_to_bf16_bits(src[i]));
    REQUIRE(h[i].bits == f32_to_f16_bits(src[i]));
    if (!std::isnan(src[i])) REQUIRE(d[i] == static_cast<double>(src[i]));
  }

  // Back to f32 and f64: widening is exact.
  buffer<float> fb({n}), fh({n});
  buffer<double> db({n});
  ops::copy(b, fb);
  ops::copy(h, fh);
  ops::copy(b, db);
  for (std::int64_t i = 4; i < n; ++i) {
    REQUIRE(fb[i] == bf16_bits_to_f32(b[i].bits));
    REQUIRE(fh[i] == f16_bits_to_f32(h[i].bits));
    REQUIRE(db[i] == static_cast<double>(bf16_bits_to_f32(b[i].bits)));
  }
  REQUIRE(std::isnan(fb[2]));
  REQUIRE(std::isnan(fh[2]));

  // f64 -> f32 rounds to nearest.
  buffer<double> wide({n});
  fill_uniform(wide, g, -1e3, 1e3);
  buffer<float> narrow({n});
  ops::copy(wide, narrow);
  for (std::int64_t i = 0; i < n; ++i) REQUIRE(narrow[i] == static_cast<float>(wide[i]));
}

TEST_CASE("copy handles strided and transposed views", "[cpu]") {
  rng g(2);
  // src: a [5, 6, 7, 8] f64 buffer viewed as a sliced, transposed [3, 7, 6, 4] tensor.
  buffer<double> base({5, 6, 7, 8});
  fill_uniform(base, g, -1, 1);
  tensor src = base.t.slice(0, 1, 4).transpose(1, 2).slice(3, 1, 8, 2);
  REQUIRE(src.sizes() == shape{3, 7, 6, 4});
  REQUIRE(!src.is_contiguous());

  SECTION("into a contiguous tensor of the same dtype") {
    buffer<double> dst({3, 7, 6, 4});
    ops::copy(src, dst);
    for (std::int64_t i = 0; i < dst.size(); ++i) REQUIRE(dst[i] == base[strided_offset(src, i)]);
  }
  SECTION("into a transposed f32 view") {
    buffer<float> out({4, 6, 7, 3});
    tensor dst = out.t.transpose(0, 3).transpose(1, 2);  // [3, 7, 6, 4]
    ops::copy(src, dst);
    for (std::int64_t i = 0; i < src.numel(); ++i)
      REQUIRE(out[strided_offset(dst, i)] == static_cast<float>(base[strided_offset(src, i)]));
  }
  SECTION("between two strided views of one rank-6 buffer") {
    buffer<float> a({2, 3, 2, 3, 2, 3});
    fill_uniform(a, g, -1, 1);
    buffer<bf16_t> b({3, 2, 3, 2, 3, 2});
    tensor s = a.t.transpose(0, 5).transpose(2, 3);  // [3, 3, 3, 2, 2, 2]
    tensor d = b.t.transpose(1, 4);                  // [3, 3, 3, 2, 2, 2]
    REQUIRE(s.sizes() == d.sizes());
    ops::copy(s, d);
    for (std::int64_t i = 0; i < s.numel(); ++i)
      REQUIRE(b[strided_offset(d, i)].bits == f32_to_bf16_bits(a[strided_offset(s, i)]));
  }
  SECTION("of integers and single elements") {
    buffer<std::int64_t> ids({100, 50});
    for (std::int64_t i = 0; i < ids.size(); ++i) ids[i] = i * 7919;
    buffer<std::int64_t> col({50, 100});
    ops::copy(ids.t.transpose(0, 1), col);
    for (std::int64_t r = 0; r < 50; ++r)
      for (std::int64_t c = 0; c < 100; ++c) REQUIRE(col[r * 100 + c] == ids[c * 50 + r]);
    buffer<std::uint8_t> bytes({4, 4});
    for (std::int64_t i = 0; i < 16; ++i) bytes[i] = static_cast<std::uint8_t>(i);
    buffer<std::uint8_t> one({1, 1});
    ops::copy(bytes.t.slice(0, 2, 3).slice(1, 3, 4), one);
    REQUIRE(one[0] == 11);
  }
  SECTION("into a narrowed destination whose rows are not contiguous") {
    buffer<double> rows({40, 30});
    fill_uniform(rows, g, -1, 1);
    buffer<double> wide({40, 50}, 7.0);
    const tensor dst = wide.t.narrow(1, 10, 30);
    ops::copy(rows, dst);
    for (std::int64_t r = 0; r < 40; ++r)
      for (std::int64_t c = 0; c < 50; ++c)
        REQUIRE(wide[r * 50 + c] == (c >= 10 && c < 40 ? rows[r * 30 + c - 10] : 7.0));
  }
  SECTION("of batched transposes larger than a tile") {
    buffer<float> a({3, 70, 45});
    fill_uniform(a, g, -1, 1);
    const tensor at = a.t.transpose(1, 2);  // [3, 45, 70]
    buffer<float> same({3, 45, 70});
    buffer<f16_t> half({3, 45, 70});
    ops::copy(at, same);
    ops::copy(at, half);
    for (std::int64_t i = 0; i < same.size(); ++i) {
      REQUIRE(same[i] == a[strided_offset(at, i)]);
      REQUIRE(half[i].bits == f32_to_f16_bits(a[strided_offset(at, i)]));
    }
    buffer<double> wide({1000, 1003});  // f64 -> f32 while transposing, in parallel
    fill_uniform(wide, g, -1, 1);
    buffer<float> out({1003, 1000});
    ops::copy(wide.t.transpose(0, 1), out);
    for (std::int64_t r = 0; r < 1003; ++r)
      for (std::int64_t c = 0; c < 1000; ++c)
        REQUIRE(out[r * 1000 + c] == static_cast<float>(wide[c * 1003 + r]));
  }
  SECTION("of a large strided f32 view in parallel") {
    buffer<float> big({1001, 2003});
    fill_uniform(big, g, -1, 1);
    tensor s = big.t.slice(1, 1, 2003, 2);  // [1001, 1001], stride 2 in the last dimension
    buffer<float> dst({1001, 1001});
    ops::copy(s, dst);
    for (std::int64_t i = 0; i < dst.size(); ++i) REQUIRE(dst[i] == big[strided_offset(s, i)]);
  }
}

TEMPLATE_TEST_CASE("add mul axpy and scale match a double reference", "[cpu]", float, double) {
  using T = TestType;
  rng g(3);
  const double tol = 2 * eps_of<T>;  // one rounding of an exact result (two for axpy)
  for (std::int64_t n : sizes) {
    buffer<T> a({n}), b({n}), out({n});
    fill_uniform(a, g, -2, 2);
    fill_uniform(b, g, -2, 2);
    std::vector<double> ref(n);

    ops::add(a, b, out);
    for (std::int64_t i = 0; i < n; ++i) ref[i] = double(a[i]) + double(b[i]);
    require_close(out, ref, tol, 0);

    ops::mul(a, b, out);
    for (std::int64_t i = 0; i < n; ++i) ref[i] = double(a[i]) * double(b[i]);
    require_close(out, ref, tol, 0);

    // axpy: y += alpha * x, y aliasing nothing; alpha is exact in both types.
    for (std::int64_t i = 0; i < n; ++i) ref[i] = double(b[i]) + 0.75 * double(a[i]);
    ops::axpy(0.75, a, b);
    require_close(b, ref, tol, 4 * eps_of<T>);

    for (std::int64_t i = 0; i < n; ++i) ref[i] = double(b[i]) * -0.5;
    ops::scale(b, -0.5);
    require_close(b, ref, 0, 0);  // scaling by a power of two is exact

    // out may alias an input.
    for (std::int64_t i = 0; i < n; ++i) ref[i] = double(a[i]) + double(b[i]);
    ops::add(a, b, a);
    require_close(a, ref, tol, 0);
  }
}

TEMPLATE_TEST_CASE("add_bias and sum_rows work row by row", "[cpu]", float, double) {
  using T = TestType;
  rng g(4);
  for (auto [rows, cols] :
       {std::pair<std::int64_t, std::int64_t>{3, 50257}, {1000, 7}, {1, 1}, {257, 130}}) {
    buffer<T> x({rows, cols}), bias({cols}), acc({cols});
    fill_uniform(x, g, -1, 1);
    fill_uniform(bias, g, -1, 1);
    fill_uniform(acc, g, -1, 1);

    std::vector<double> ref(rows * cols);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c)
        ref[r * cols + c] = double(x[r * cols + c]) + double(bias[c]);
    ops::add_bias(x, bias);
    require_close(x, ref, eps_of<T>, 0);

    // sum_rows adds into out: the reference starts from out's old values. The kernel sums a
    // column in double (error ~ rows * 2^-53 * sum |x|), rounds that sum to T and adds it to the
    // old value (two roundings in T).
    std::vector<double> old(cols), sums(cols), mags(cols);
    for (std::int64_t c = 0; c < cols; ++c) old[c] = double(acc[c]);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c) {
        sums[c] += double(x[r * cols + c]);
        mags[c] += std::fabs(double(x[r * cols + c]));
      }
    ops::sum_rows(x, acc);
    for (std::int64_t c = 0; c < cols; ++c) {
      const double ref = old[c] + sums[c];
      const double tol =
          2 * eps_of<T> * (std::fabs(sums[c]) + std::fabs(ref)) + rows * 0x1p-52 * mags[c];
      INFO("column " << c);
      REQUIRE(std::fabs(double(acc[c]) - ref) <= tol);
    }
  }
}

TEMPLATE_TEST_CASE("sum and sum_squares accumulate in double", "[cpu]", float, double) {
  using T = TestType;
  rng g(5);
  for (std::int64_t n : sizes) {
    buffer<T> x({n});
    fill_uniform(x, g, -1, 3);
    long double s = 0, q = 0, abs_sum = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      s += static_cast<long double>(x[i]);
      q += static_cast<long double>(x[i]) * x[i];
      abs_sum += std::fabs(static_cast<long double>(x[i]));
    }
    // A double sum of n terms errs by at most about n * 2^-53 times the sum of magnitudes.
    const double bound = static_cast<double>(n) * 0x1p-53 * static_cast<double>(abs_sum) + 1e-300;
    REQUIRE(std::fabs(ops::sum(x) - static_cast<double>(s)) <= bound);
    // Each square is exact in double for f32 input and rounded once for f64 input.
    const double bound2 = static_cast<double>(n + 1) * 0x1p-53 * static_cast<double>(q);
    REQUIRE(std::fabs(ops::sum_squares(x) - static_cast<double>(q)) <= bound2);
  }
  SECTION("independently of the thread count") {
    buffer<T> x({1000003});
    fill_uniform(x, g, -1, 1);
    const double many = ops::sum(x);
    const int threads = parallel::num_threads();
    parallel::set_num_threads(1);
    const double one = ops::sum(x);
    parallel::set_num_threads(threads);
    REQUIRE(one == many);
  }
}

TEST_CASE("all_finite finds inf and nan anywhere", "[cpu]") {
  const double bad[] = {std::numeric_limits<double>::infinity(),
                        -std::numeric_limits<double>::infinity(),
                        std::numeric_limits<double>::quiet_NaN()};
  for (std::int64_t n : sizes) {
    buffer<float> f({n});
    buffer<double> d({n});
    buffer<bf16_t> b({n});
    buffer<f16_t> h({n});
    ops::fill(f, 1e30);  // finite in f32; 65504 is the f16 limit, so use a smaller value there
    ops::fill(d, 1e300);
    ops::fill(b, 1e38);
    ops::fill(h, 65504);
    REQUIRE(ops::all_finite(f));
    REQUIRE(ops::all_finite(d));
    REQUIRE(ops::all_finite(b));
    REQUIRE(ops::all_finite(h));
    for (std::int64_t at : {std::int64_t{0}, n / 2, n - 1}) {
      for (double v : bad) {
        float f_old = f[at];
        f[at] = static_cast<float>(v);
        REQUIRE(!ops::all_finite(f));
        f[at] = f_old;
        double d_old = d[at];
        d[at] = v;
        REQUIRE(!ops::all_finite(d));
        d[at] = d_old;
        bf16_t b_old = b[at];
        b[at].bits = f32_to_bf16_bits(static_cast<float>(v));
        REQUIRE(!ops::all_finite(b));
        b[at] = b_old;
        f16_t h_old = h[at];
        h[at].bits = f32_to_f16_bits(static_cast<float>(v));
        REQUIRE(!ops::all_finite(h));
        h[at] = h_old;
      }
    }
  }
}

TEST_CASE("the fast exp is within two ulp over the float range", "[cpu]") {
  // Every 1009th float in [-87, 88] (both signs walk the bit patterns), against double exp.
  double worst = 0;
  float worst_x = 0;
  auto check = [&](float x) {
    const double ref = std::exp(static_cast<double>(x));
    const float got = cpu::exp_fast(x);
    const float rf = static_cast<float>(ref);
    const double ulp = static_cast<double>(std::nextafter(rf, INFINITY) - rf);
    const double err = std::fabs(static_cast<double>(got) - ref) / ulp;
    if (err > worst) {
      worst = err;
      worst_x = x;
    }
  };
  for (std::uint32_t u = 0; u <= 0x42b00000u; u += 1009) {  // +0 .. 88
    float x;
    std::memcpy(&x, &u, 4);
    check(x);
  }
  for (std::uint32_t u = 0x80000000u; u <= 0xc2ae0000u; u += 1009) {  // -0 .. -87
    float x;
    std::memcpy(&x, &u, 4);
    check(x);
  }
  for (float x : {-87.0f, 88.0f, 0.0f, 1.0f, -1.0f, 0.5f * 0.693147182f}) check(x);
  INFO("worst " << worst << " ulp at x = " << worst_x);
  REQUIRE(worst <= 2.0);
  // Beyond the range: subnormals, then 0; inf; NaN stays NaN.
  REQUIRE(std::fabs(cpu::exp_fast(-100.0f) - std::exp(-100.0)) <= 0x1p-149);  // one subnormal step
  REQUIRE(cpu::exp_fast(-104.0f) == 0.0f);
  REQUIRE(cpu::exp_fast(-std::numeric_limits<float>::infinity()) == 0.0f);
  REQUIRE(cpu::exp_fast(88.7f) == Approx(std::exp(double(88.7f))).epsilon(1e-6));
  REQUIRE(std::isinf(cpu::exp_fast(88.8f)));
  REQUIRE(std::isinf(cpu::exp_fast(std::numeric_limits<float>::infinity())));
  REQUIRE(std::isnan(cpu::exp_fast(std::numeric_limits<float>::quiet_NaN())));
}

TEST_CASE("elementwise ops reject bad arguments", "[cpu]") {
  buffer<float> a({4, 6}), b({4, 6}), c({6, 4});
  buffer<double> d({4, 6});
  buffer<bf16_t> h({4, 6});
  REQUIRE_THROWS_WITH(ops::add(a, c, b), Catch::Contains("add: b has shape [6, 4]"));
  REQUIRE_THROWS_WITH(ops::mul(a, d, b), Catch::Contains("mul: b has dtype f64"));
  REQUIRE_THROWS_WITH(ops::scale(a.t.transpose(0, 1), 2.0),
                      Catch::Contains("scale: x must be contiguous"));
  REQUIRE_THROWS_WITH(ops::gelu(h, a), Catch::Contains("gelu: y has dtype f32 but x has bf16"));
  buffer<std::int32_t> i({4, 6});
  REQUIRE_THROWS_WITH(ops::sum(i), Catch::Contains("sum: x must be a floating dtype"));
  REQUIRE_THROWS_WITH(ops::copy(i, a), Catch::Contains("copy: cannot convert i32 to f32"));
  REQUIRE_THROWS_WITH(ops::copy(a, c), Catch::Contains("copy: dst has shape [6, 4]"));
  buffer<float> bias({5});
  REQUIRE_THROWS_WITH(ops::add_bias(a, bias),
                      Catch::Contains("add_bias: bias must have shape [6]"));
}
