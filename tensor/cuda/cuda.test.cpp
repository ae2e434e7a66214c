// Tests of the CUDA backend, part 1: data movement, elementwise ops (f32 and 16-bit), reductions,
// matmul and AdamW. Each op runs through troupe::ops on host tensors and on device copies of the
// same inputs; results come back and are compared. [gpu] tests are skipped without a GPU; the
// GEMM layout test needs none.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "tensor/cuda/gemm_plan.hpp"
#include "tensor/cuda/test_util.hpp"
#include "tensor/ops.hpp"

namespace {

using namespace troupe;
using namespace troupe::cuda_test;

// The same view of a host tensor and of its device copy.
tensor odd_view(const tensor& x) {
  return x.transpose(0, 2).slice(1, 1, 5, 2);
}

}  // namespace

TEST_CASE("cuda fill writes every dtype", "[gpu]") {
  TROUPE_NEED_GPU();
  for (dtype t : {dtype::f32, dtype::bf16, dtype::f16, dtype::f64, dtype::i32, dtype::i64}) {
    INFO(dtype_name(t));
    owned_tensor x = empty({3, 7}, t, device::cuda());
    ops::fill(x, -2.5);
    double want = (t == dtype::i32 || t == dtype::i64) ? -2.0 : -2.5;  // casts truncate
    for (double v : values(x)) REQUIRE(v == want);
    ops::fill(x, 0.0);
    for (double v : values(x)) REQUIRE(v == 0.0);
  }
}

TEST_CASE("cuda copy handles strided views like the cpu", "[gpu]") {
  TROUPE_NEED_GPU();
  owned_tensor x = random({4, 6, 5}, 1);
  owned_tensor gx = gpu(x);
  // strided source, contiguous destination
  owned_tensor want = empty(odd_view(x).sizes());
  ops::copy(odd_view(x), want);
  owned_tensor got = empty(odd_view(x).sizes(), dtype::f32, device::cuda());
  ops::copy(odd_view(gx), got);
  require_close(got, want, 0, 0, "strided source");
  // contiguous source, strided destination (the rest of the destination is untouched)
  owned_tensor dst = random({4, 6, 5}, 2);
  owned_tensor gdst = gpu(dst);
  owned_tensor src = random(odd_view(x).sizes(), 3);
  ops::copy(src, odd_view(dst));
  ops::copy(gpu(src), odd_view(gdst));
  require_close(gdst, dst, 0, 0, "strided destination");
  // integer copies move bits
  owned_tensor ids = empty({2, 3}, dtype::i64);
  for (std::int64_t i = 0; i < 6; ++i) ids.data_as<std::int64_t>()[i] = (i - 2) * 1000000007LL;
  owned_tensor gids = gpu(ids);
  owned_tensor gids_t = empty({3, 2}, dtype::i64, device::cuda());
  ops::copy(gids.transpose(0, 1), gids_t);
  std::vector<double> v = values(gids_t);
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 2; ++c)
      REQUIRE(v[r * 2 + c] == static_cast<double>((c * 3 + r - 2) * 1000000007LL));
}

TEST_CASE("cuda copy converts between f32 bf16 f16 and f64 rounding to nearest even", "[gpu]") {
  TROUPE_NEED_GPU();
  owned_tensor x = random({5, 9}, 4, -70000.0f, 70000.0f);  // beyond f16's range: inf
  x.data_as<float>()[0] = 1.0f + 0x1p-8f;                   // a bf16 tie: rounds to even (1.0)
  x.data_as<float>()[1] = 1e-6f;                            // an f16 subnormal
  owned_tensor gx = gpu(x);
  for (dtype t : {dtype::bf16, dtype::f16}) {
    INFO(dtype_name(t));
    owned_tensor g16 = empty({5, 9}, t, device::cuda());
    ops::copy(gx, g16);
    std::vector<double> got = values(g16), want = values(to_16bit(x, t));
    for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == want[i]);  // bit-exact rounding
    owned_tensor back = empty({5, 9}, dtype::f32, device::cuda());
    ops::copy(g16, back);  // 16-bit -> f32 is exact
    require_close(back, to_16bit(x, t), 0, 0, "back to f32");
  }
  // bf16 -> f16 goes through f32 (exact), then rounds to f16
  owned_tensor gb = gpu(to_16bit(x, dtype::bf16));
  owned_tensor gh = empty({5, 9}, dtype::f16, device::cuda());
  ops::copy(gb, gh);
  require_close(gh, to_16bit(rounded(x, dtype::bf16), dtype::f16), 0, 0, "bf16 to f16");
  // f32 <-> f64
  owned_tensor gd = empty({5, 9}, dtype::f64, device::cuda());
  ops::copy(gx, gd);
  require_close(gd, x, 0, 0, "f32 to f64");
}

TEST_CASE("cuda elementwise ops and activations match the cpu in f32", "[gpu]") {
  TROUPE_NEED_GPU();
  const shape s{7, 131};
  owned_tensor a = random(s, 10, -4, 4), b = random(s, 11, -4, 4), c = random(s, 12, -4, 4);
  owned_tensor ga = gpu(a), gb = gpu(b), gc = gpu(c);
  owned_tensor out = empty(s), gout = empty(s, dtype::f32, device::cuda());
  owned_tensor out2 = empty(s), gout2 = empty(s, dtype::f32, device::cuda());
  const double rel = 1e-5, abs = 1e-6;  // a few f32 ulps of the transcendental functions

  ops::add(a, b, out);
  ops::add(ga, gb, gout);
  require_close(gout, out, rel, abs, "add");
  ops::mul(a, b, out);
  ops::mul(ga, gb, gout);
  require_close(gout, out, rel, abs, "mul");
  ops::gelu(a, out);
  ops::gelu(ga, gout);
  require_close(gout, out, rel, abs, "gelu");
  ops::gelu_backward(a, b, out);
  ops::gelu_backward(ga, gb, gout);
  require_close(gout, out, rel, abs, "gelu_backward");
  ops::silu(a, out);
  ops::silu(ga, gout);
  require_close(gout, out, rel, abs, "silu");
  ops::silu_backward(a, b, out);
  ops::silu_backward(ga, gb, gout);
  require_close(gout, out, rel, abs, "silu_backward");
  ops::swiglu(a, b, out);
  ops::swiglu(ga, gb, gout);
  require_close(gout, out, rel, abs, "swiglu");
  ops::swiglu_backward(a, b, c, out, out2);
  ops::swiglu_backward(ga, gb, gc, gout, gout2);
  require_close(gout, out, rel, abs, "swiglu_backward dgate");
  require_close(gout2, out2, rel, abs, "swiglu_backward dup");

  // in place: axpy, scale, add_bias, add with out aliasing a
  ops::axpy(-0.75, b, a);
  ops::axpy(-0.75, gb, ga);
  require_close(ga, a, rel, abs, "axpy");
  ops::scale(a, 1.5);
  ops::scale(ga, 1.5);
  require_close(ga, a, rel, abs, "scale");
  owned_tensor bias = random({131}, 13);
  ops::add_bias(a, bias);
  ops::add_bias(ga, gpu(bias));
  require_close(ga, a, rel, abs, "add_bias");
  ops::add(a, b, a);
  ops::add(ga, gb, ga);
  require_close(ga, a, rel, abs, "add in place");
}

TEST_CASE("cuda elementwise ops in bf16 and f16 match f32 on the rounded inputs", "[gpu]") {
  TROUPE_NEED_GPU();
  const shape s{5, 77};
  for (dtype t : {dtype::bf16, dtype::f16}) {
    INFO(dtype_name(t));
    // The device computes in f32 from the same rounded inputs, then rounds once: at most half a
    // 16-bit ulp from the f32 reference (plus f32 noise), so one ulp16 of relative slack.
    const double rel = ulp16(t), abs = 1e-6;
    owned_tensor a = rounded(random(s, 20, -4, 4), t), b = rounded(random(s, 21, -4, 4), t);
    owned_tensor c = rounded(random(s, 22, -4, 4), t);
    owned_tensor ga = gpu(to_16bit(a, t)), gb = gpu(to_16bit(b, t)), gc = gpu(to_16bit(c, t));
    owned_tensor out = empty(s), out2 = empty(s);
    owned_tensor gout = empty(s, t, device::cuda()), gout2 = empty(s, t, device::cuda());

    ops::add(a, b, out);
    ops::add(ga, gb, gout);
    require_close(gout, out, rel, abs, "add");
    ops::mul(a, b, out);
    ops::mul(ga, gb, gout);
    require_close(gout, out, rel, abs, "mul");
    ops::gelu(a, out);
    ops::gelu(ga, gout);
    require_close(gout, out, rel, abs, "gelu");
    ops::gelu_backward(a, b, out);
    ops::gelu_backward(ga, gb, gout);
    require_close(gout, out, rel, abs, "gelu_backward");
    ops::silu(a, out);
    ops::silu(ga, gout);
    require_close(gout, out, rel, abs, "silu");
    ops::silu_backward(a, b, out);
    ops::silu_backward(ga, gb, gout);
    require_close(gout, out, rel, abs, "silu_backward");
    ops::swiglu(a, b, out);
    ops::swiglu(ga, gb, gout);
    require_close(gout, out, rel, abs, "swiglu");
    ops::swiglu_backward(a, b, c, out, out2);
    ops::swiglu_backward(ga, gb, gc, gout, gout2);
    require_close(gout, out, rel, abs, "swiglu_backward dgate");
    require_close(gout2, out2, rel, abs, "swiglu_backward dup");
    // in place ops: one rounding per op, so compare after each against the rounded reference
    ops::axpy(0.5, b, a);
    ops::axpy(0.5, gb, ga);
    require_close(ga, a, rel, abs, "axpy");
    a = rounded(a, t);
    ops::scale(a, -3.0);
    ops::scale(ga, -3.0);
    require_close(ga, a, rel, abs, "scale");
    a = rounded(a, t);
    owned_tensor bias = rounded(random({77}, 23), t);
    ops::add_bias(a, bias);
    ops::add_bias(ga, gpu(to_16bit(bias, t)));
    require_close(ga, a, rel, abs, "add_bias");
  }
}

TEST_CASE("cuda reductions match the cpu", "[gpu]") {
  TROUPE_NEED_GPU();
  owned_tensor x = random({100003}, 30, 0.0f, 1.0f);
  owned_tensor gx = gpu(x);
  // Both sides accumulate the f32 values in f64, in different orders: each is within
  // n * 2^-53 * sum |terms| of the exact sum (squares of f32 values are exact in f64), so they
  // differ by at most twice that: 2e-11 relative here (an f32 sum would err by ~1e-5).
  const std::vector<double> xs = values(x);
  double mag = 0, mag2 = 0;
  for (double v : xs) {
    mag += std::abs(v);
    mag2 += v * v;
  }
  const double dn = static_cast<double>(xs.size());
  REQUIRE(std::abs(ops::sum(gx) - ops::sum(x)) <= 2 * dn * 0x1p-53 * mag);
  REQUIRE(std::abs(ops::sum_squares(gx) - ops::sum_squares(x)) <= 2 * dn * 0x1p-53 * mag2);

  REQUIRE(ops::all_finite(gx));
  ops::fill(gx.narrow(0, 777, 1), std::numeric_limits<double>::quiet_NaN());
  REQUIRE_FALSE(ops::all_finite(gx));
  ops::fill(gx.narrow(0, 777, 1), 0.5);
  REQUIRE(ops::all_finite(gx));
  ops::fill(gx.narrow(0, 100002, 1), -std::numeric_limits<double>::infinity());
  REQUIRE_FALSE(ops::all_finite(gx));

  owned_tensor m = random({37, 70}, 31), out = random({70}, 32);
  owned_tensor gm = gpu(m), gout = gpu(out);
  // The device adds the 37 rows and the old value in f32 (38 roundings), the host in double and
  // rounds twice: within 40 u (sum_r |m_rc| + |out_c|) of each other, in any order.
  std::vector<double> sr_bound(70);
  {
    const std::vector<double> mv = values(m), ov = values(out);
    for (std::size_t c = 0; c < 70; ++c) {
      double s = std::abs(ov[c]);
      for (std::size_t r = 0; r < 37; ++r) s += std::abs(mv[r * 70 + c]);
      sr_bound[c] = 40 * u32 * s;
    }
  }
  ops::sum_rows(m, out);
  ops::sum_rows(gm, gout);
  require_within(gout, out, sr_bound, "sum_rows");

  for (dtype t : {dtype::bf16, dtype::f16}) {
    INFO(dtype_name(t));
    owned_tensor y = random({4097}, 33, -2.0f, 2.0f);
    owned_tensor gy = gpu(to_16bit(y, t));
    // Against a long double sum of the same values (squares of 16-bit values are exact): the
    // device's f64 sum errs by at most n * 2^-53 * sum |terms|, in any order.
    long double s = 0, s2 = 0, ys = 0;
    for (double v : values(rounded(y, t))) {
      s += v;
      s2 += static_cast<long double>(v) * v;
      ys += std::abs(v);
    }
    const double bound = 4097 * 0x1p-53 * static_cast<double>(ys);
    REQUIRE(std::abs(ops::sum(gy) - static_cast<double>(s)) <= bound);
    REQUIRE(std::abs(ops::sum_squares(gy) - static_cast<double>(s2)) <=
            4097 * 0x1p-53 * static_cast<double>(s2));
    REQUIRE(ops::all_finite(gy));
    ops::fill(gy.narrow(0, 5, 1), std::numeric_limits<double>::infinity());
    REQUIRE_FALSE(ops::all_finite(gy));
  }
}

namespace {

// BLAS semantics of the planned column-major call, in f64 on the host: c' = a' @ b' (+ beta c').
void run_plan(const cuda::gemm_plan& p, const float* b, const float* a, float* c, double alpha,
              double beta) {
  auto op = [](const float* x, const cuda::gemm_operand& o, std::int64_t r, std::int64_t col) {
    return static_cast<double>(o.transpose ? x[col + r * o.ld] : x[r + col * o.ld]);
  };
  for (std::int64_t i = 0; i < p.m; ++i)
    for (std::int64_t j = 0; j < p.n; ++j) {
      double s = 0;
      for (std::int64_t l = 0; l < p.k; ++l) s += op(b, p.b, i, l) * op(a, p.a, l, j);
      float& cij = c[i + j * p.ldc];
      cij = static_cast<float>(alpha * s + (beta == 0 ? 0.0 : beta * cij));
    }
}

double at(const tensor& x, std::int64_t r, std::int64_t c) {
  return x.data_as<float>()[r * x.stride(0) + c * x.stride(1)];
}

}  // namespace

TEST_CASE("gemm plan maps row major views onto a column major call") {
  struct dims {
    std::int64_t m, k, n;
  };
  for (dims d : {dims{3, 4, 5}, dims{1, 4, 5}, dims{3, 1, 5}, dims{3, 4, 1}, dims{1, 1, 1}}) {
    for (int variant = 0; variant < 8; ++variant) {
      bool ta = variant & 1, tb = variant & 2, wide_c = variant & 4;
      INFO("m " << d.m << " k " << d.k << " n " << d.n << " variant " << variant);
      owned_tensor as = ta ? random({d.k, d.m}, 40) : random({d.m, d.k}, 40);
      owned_tensor bs = tb ? random({d.n, d.k}, 41) : random({d.k, d.n}, 41);
      owned_tensor cs = random({d.m, d.n + (wide_c ? 3 : 0)}, 42);
      tensor a = ta ? as.transpose(0, 1) : as.view();
      tensor b = tb ? bs.transpose(0, 1) : bs.view();
      tensor c = cs.narrow(1, wide_c ? 2 : 0, d.n);
      std::vector<double> want(d.m * d.n);
      for (std::int64_t r = 0; r < d.m; ++r)
        for (std::int64_t col = 0; col < d.n; ++col) {
          double s = 0;
          for (std::int64_t l = 0; l < d.k; ++l) s += at(a, r, l) * at(b, l, col);
          want[r * d.n + col] = 2.0 * s - 0.5 * at(c, r, col);
        }
      cuda::gemm_plan p = cuda::plan_gemm(a, b, c);
      REQUIRE(p.ldc >= std::max<std::int64_t>(1, p.m));
      REQUIRE(p.b.ld >= std::max<std::int64_t>(1, p.b.transpose ? p.k : p.m));
      REQUIRE(p.a.ld >= std::max<std::int64_t>(1, p.a.transpose ? p.n : p.k));
      run_plan(p, static_cast<const float*>(b.data()), static_cast<const float*>(a.data()),
               static_cast<float*>(c.data()), 2.0, -0.5);
      // run_plan forms the same double products in the same order as want and rounds once, so a
      // right plan gives want rounded to f32 bit for bit (a wrong one reads other elements).
      for (std::int64_t r = 0; r < d.m; ++r)
        for (std::int64_t col = 0; col < d.n; ++col)
          REQUIRE(at(c, r, col) == static_cast<float>(want[r * d.n + col]));
    }
  }
  owned_tensor store = random({64}, 43);
  tensor no_unit = tensor::strided(store.data(), 256, dtype::f32, {3, 4}, {8, 2}, 0);
  tensor ok = tensor::strided(store.data(), 256, dtype::f32, {4, 4}, {4, 1}, 0);
  REQUIRE_THROWS_WITH(cuda::plan_gemm(no_unit, ok, ok.narrow(0, 0, 3)),
                      Catch::Contains("cuda matmul: a has strides cuBLAS cannot express"));
  tensor overlap = tensor::strided(store.data(), 256, dtype::f32, {3, 4}, {2, 1}, 0);
  REQUIRE_THROWS_WITH(cuda::plan_gemm(ok.narrow(0, 0, 3), ok, overlap),
                      Catch::Contains("c rows overlap"));
}

TEST_CASE("cuda matmul matches the cpu for transposed and strided views", "[gpu]") {
  TROUPE_NEED_GPU();
  const std::int64_t m = 33, k = 65, n = 17;
  for (int variant = 0; variant < 4; ++variant) {
    bool ta = variant & 1, tb = variant & 2;
    INFO("transpose a " << ta << " transpose b " << tb);
    owned_tensor as = ta ? random({k, m}, 50) : random({m, k}, 50);
    owned_tensor bs = tb ? random({n, k}, 51) : random({k, n}, 51);
    owned_tensor cs = random({m, n + 5}, 52);
    owned_tensor gas = gpu(as), gbs = gpu(bs), gcs = gpu(cs);
    auto a_of = [&](const tensor& x) { return ta ? x.transpose(0, 1) : x; };
    auto b_of = [&](const tensor& x) { return tb ? x.transpose(0, 1) : x; };
    // Full f32 on both sides (context.cu keeps cuBLAS off TF32), each within (k + 2) u mag of
    // the exact result in its own order (test_util.hpp): 2 (k + 2) u mag apart. Columns outside
    // the view stay untouched (bound 0).
    auto bound_of = [&](double alpha, double beta) {
      owned_tensor c0 = empty({m, n});
      ops::copy(cs.narrow(1, 3, n), c0);
      const std::vector<double> mag = gemm_magnitudes(a_of(as), b_of(bs), c0, alpha, beta);
      std::vector<double> bound(static_cast<std::size_t>(m * (n + 5)), 0.0);
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j)
          bound[i * (n + 5) + 3 + j] = 2 * (k + 2) * u32 * mag[i * n + j];
      return bound;
    };
    std::vector<double> bound = bound_of(1.5, 0.25);
    ops::matmul(a_of(as), b_of(bs), cs.narrow(1, 3, n), 1.5, 0.25);
    ops::matmul(a_of(gas), b_of(gbs), gcs.narrow(1, 3, n), 1.5, 0.25);
    require_within(gcs, cs, bound, "c");
    bound = bound_of(1.0, 0.0);
    ops::matmul(a_of(as), b_of(bs), cs.narrow(1, 3, n));
    ops::matmul(a_of(gas), b_of(gbs), gcs.narrow(1, 3, n));
    require_within(gcs, cs, bound, "c with beta 0");
  }
  // K = 0: c = beta * c
  owned_tensor a = random({4, 3}, 53), b = random({3, 6}, 54), c = random({4, 6}, 55);
  owned_tensor ga = gpu(a), gb = gpu(b), gc = gpu(c);
  ops::matmul(ga.narrow(1, 0, 0), gb.narrow(0, 0, 0), gc, 1.0, -2.0);
  ops::scale(c, -2.0);
  require_close(gc, c, 1e-6, 0, "k = 0");
}

TEST_CASE("cuda matmul in bf16 and f16 matches f32 on the rounded inputs", "[gpu]") {
  TROUPE_NEED_GPU();
  const std::int64_t m = 40, k = 96, n = 24;
  for (dtype t : {dtype::bf16, dtype::f16}) {
    for (int variant = 0; variant < 8; ++variant) {
      bool ta = variant & 1, tb = variant & 2;
      const double beta = variant & 4 ? 0.0 : 1.0;  // accumulating into c, and overwriting it
      INFO(dtype_name(t) << " transpose a " << ta << " transpose b " << tb << " beta " << beta);
      owned_tensor as = rounded(ta ? random({k, m}, 60) : random({m, k}, 60), t);
      owned_tensor bs = rounded(tb ? random({n, k}, 61) : random({k, n}, 61), t);
      owned_tensor c = rounded(random({m, n}, 62), t);
      owned_tensor gas = gpu(to_16bit(as, t)), gbs = gpu(to_16bit(bs, t)), gc = gpu(to_16bit(c, t));
      auto a_of = [&](const tensor& x) { return ta ? x.transpose(0, 1) : x; };
      auto b_of = [&](const tensor& x) { return tb ? x.transpose(0, 1) : x; };
      const std::vector<double> mag = gemm_magnitudes(a_of(as), b_of(bs), c, 0.5, beta);
      ops::matmul(a_of(as), b_of(bs), c, 0.5, beta);
      ops::matmul(a_of(gas), b_of(gbs), gc, 0.5, beta);
      // Products of 16-bit values are exact in f32 and both sides accumulate in f32, each within
      // (k + 2) u mag of the exact result in its own order; the device then rounds once to 16
      // bits (at most half an ulp, below ulp16 relative).
      const std::vector<double> want = values(c);
      std::vector<double> bound(want.size());
      for (std::size_t i = 0; i < want.size(); ++i)
        bound[i] = ulp16(t) * std::abs(want[i]) + (1 + ulp16(t)) * 2 * (k + 2) * u32 * mag[i] +
                   0x1p-25;  // half the spacing of f16 subnormals
      require_within(gc, c, bound, "c");
    }
  }
}

TEST_CASE("cuda adamw matches the cpu", "[gpu]") {
  TROUPE_NEED_GPU();
  const shape s{1000};
  owned_tensor p = random(s, 70), g = random(s, 71), m = random(s, 72, -0.1f, 0.1f);
  owned_tensor v = random(s, 73, 0.0f, 0.01f);
  owned_tensor gp = gpu(p), gg = gpu(g), gm = gpu(m), gv = gpu(v);
  ops::adamw_options opt;
  opt.lr = 1e-2;
  opt.weight_decay = 0.1;
  for (std::int64_t step : {3, 4}) {
    opt.step = step;
    ops::adamw(p, g, m, v, opt);
    ops::adamw(gp, gg, gm, gv, opt);
  }
  // Elementwise: each step rounds about ten operations per element on each side (no sums, so no
  // order to differ; sqrt and division are IEEE on the device too), ~20 u relative over two
  // steps; 1e-5 is 168 u. The absolute terms cover elements near 0.
  require_close(gp, p, 1e-5, 1e-7, "param");
  require_close(gm, m, 1e-5, 1e-7, "m");
  require_close(gv, v, 1e-5, 1e-9, "v");
}

TEST_CASE("cuda ops reject dtypes they do not support", "[gpu]") {
  TROUPE_NEED_GPU();
  owned_tensor x = zeros({4, 8}, dtype::f64, device::cuda());
  owned_tensor y = zeros({4, 8}, dtype::f64, device::cuda());
  REQUIRE_THROWS_WITH(ops::gelu(x, y), Catch::Contains("cuda gelu: dtype f64 not supported"));
  REQUIRE_THROWS_WITH(ops::matmul(x, y.transpose(0, 1), zeros({4, 4}, dtype::f64, device::cuda())),
                      Catch::Contains("cuda matmul: dtype f64 not supported"));
  // AdamW updates f32 master weights only
  owned_tensor h = zeros({4, 8}, dtype::bf16, device::cuda());
  REQUIRE_THROWS_WITH(ops::adamw(h, h, h, h, ops::adamw_options{}),
                      Catch::Contains("cuda adamw: dtype bf16 not supported"));
}
