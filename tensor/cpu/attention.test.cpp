// Tests of the CPU flash attention (troupe::ops::attention and attention_backward) against a naive
// reference that materializes the score matrix in double, and of its memory: scratch independent
// of the sequence length.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "memory/tier.hpp"
#include "tensor/cpu/attention.hpp"
#include "tensor/ops.hpp"
#include "tensor/parallel.hpp"
#include "tensor/tensor.hpp"

using namespace troupe;

namespace {

struct config {
  std::int64_t b, t, s, hq, hkv, d;
  bool causal;
};

// q/k/v and their gradients as strided views: with T == S one fused [B, T, (Hq + 2 Hkv) D + pad]
// buffer (as a fused qkv projection writes it), else a [B, T, Hq D + pad] buffer for q and a fused
// [B, S, 2 Hkv D + pad] buffer for k and v. out and dout are contiguous.
struct problem {
  config c;
  dtype type;
  owned_tensor qkv, kv, dqkv, dkv, out_buf, dout_buf, lse_buf;
  tensor q, k, v, out, dout, lse, dq, dk, dv;

  problem(const config& cfg, dtype t) : c(cfg), type(t) {
    const std::int64_t hd = c.hq * c.d, kd = c.hkv * c.d;
    if (c.t == c.s) {
      const std::int64_t w = hd + 2 * kd + 5;
      qkv = empty({c.b, c.t, w}, t);
      dqkv = empty({c.b, c.t, w}, t);
      q = view(qkv, c.t, c.hq, w, 0);
      k = view(qkv, c.s, c.hkv, w, hd);
      v = view(qkv, c.s, c.hkv, w, hd + kd);
      dq = view(dqkv, c.t, c.hq, w, 0);
      dk = view(dqkv, c.s, c.hkv, w, hd);
      dv = view(dqkv, c.s, c.hkv, w, hd + kd);
    } else {
      const std::int64_t wq = hd + 3, wkv = 2 * kd + 3;
      qkv = empty({c.b, c.t, wq}, t);
      dqkv = empty({c.b, c.t, wq}, t);
      kv = empty({c.b, c.s, wkv}, t);
      dkv = empty({c.b, c.s, wkv}, t);
      q = view(qkv, c.t, c.hq, wq, 0);
      dq = view(dqkv, c.t, c.hq, wq, 0);
      k = view(kv, c.s, c.hkv, wkv, 0);
      v = view(kv, c.s, c.hkv, wkv, kd);
      dk = view(dkv, c.s, c.hkv, wkv, 0);
      dv = view(dkv, c.s, c.hkv, wkv, kd);
    }
    out_buf = empty({c.b, c.t, c.hq, c.d}, t);
    dout_buf = empty({c.b, c.t, c.hq, c.d}, t);
    lse_buf = empty({c.b, c.hq, c.t}, t);
    out = out_buf;
    dout = dout_buf;
    lse = lse_buf;
    // Gradients start as NaN: the kernels must overwrite every element.
    for (const tensor* g : {&dq, &dk, &dv})
      for_each(*g, [&](std::int64_t o) { put(*g, o, std::numeric_limits<double>::quiet_NaN()); });
    std::mt19937 rng(static_cast<unsigned>(c.t * 7 + c.s * 13 + c.d));
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    // Queries are larger than keys so that softmax rows are peaked and the running max moves.
    fill_random(q, 3.0, u, rng);
    fill_random(k, 1.0, u, rng);
    fill_random(v, 1.0, u, rng);
    fill_random(dout, 1.0, u, rng);
  }

  tensor view(const owned_tensor& buf, std::int64_t len, std::int64_t heads, std::int64_t w,
              std::int64_t offset) const {
    return tensor::strided(buf.data(), buf.nbytes(), type, {c.b, len, heads, c.d},
                           {len * w, w, c.d, 1}, offset);
  }

  template <class F>
  static void fill_random(const tensor& x, double mag, std::uniform_real_distribution<double>& u,
                          F& rng) {
    for_each(x, [&](std::int64_t o) { put(x, o, mag * u(rng)); });
  }

  // Calls f(element offset) for every element of a [B, L, H, D] view.
  template <class F>
  static void for_each(const tensor& x, F&& f) {
    for (std::int64_t b = 0; b < x.size(0); ++b)
      for (std::int64_t t = 0; t < x.size(1); ++t)
        for (std::int64_t h = 0; h < x.size(2); ++h)
          for (std::int64_t d = 0; d < x.size(3); ++d)
            f(b * x.stride(0) + t * x.stride(1) + h * x.stride(2) + d * x.stride(3));
  }
  static void put(const tensor& x, std::int64_t o, double val) {
    if (x.type() == dtype::f32)
      static_cast<float*>(x.data())[o] = static_cast<float>(val);
    else
      static_cast<double*>(x.data())[o] = val;
  }
  static double get(const tensor& x, std::int64_t o) {
    return x.type() == dtype::f32 ? static_cast<const float*>(x.data())[o]
                                  : static_cast<const double*>(x.data())[o];
  }
  static double at(const tensor& x, std::int64_t b, std::int64_t t, std::int64_t h,
                   std::int64_t d) {
    return get(x, b * x.stride(0) + t * x.stride(1) + h * x.stride(2) + d * x.stride(3));
  }
};

// The reference, all in double: [B, L, H, D] arrays laid out contiguously.
struct reference {
  std::vector<double> out, lse, dq, dk, dv;
};

reference naive(const problem& p) {
  const config& c = p.c;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const std::int64_t group = c.hq / c.hkv, off = c.s - c.t;
  reference r;
  r.out.assign(c.b * c.t * c.hq * c.d, 0.0);
  r.dq.assign(c.b * c.t * c.hq * c.d, 0.0);
  r.lse.assign(c.b * c.hq * c.t, 0.0);
  r.dk.assign(c.b * c.s * c.hkv * c.d, 0.0);
  r.dv.assign(c.b * c.s * c.hkv * c.d, 0.0);
  auto qi = [&](std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t d) {
    return ((b * c.t + t) * c.hq + h) * c.d + d;
  };
  auto ki = [&](std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d) {
    return ((b * c.s + s) * c.hkv + h) * c.d + d;
  };
  std::vector<double> score(c.s), prob(c.s), dprob(c.s);
  for (std::int64_t b = 0; b < c.b; ++b)
    for (std::int64_t h = 0; h < c.hq; ++h) {
      const std::int64_t hk = h / group;
      for (std::int64_t i = 0; i < c.t; ++i) {
        const std::int64_t n = c.causal ? std::min(c.s, i + off + 1) : c.s;  // visible keys
        double mx = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (std::int64_t d = 0; d < c.d; ++d)
            s += problem::at(p.q, b, i, h, d) * problem::at(p.k, b, j, hk, d);
          score[j] = s * scale;
          mx = std::max(mx, score[j]);
        }
        double sum = 0;
        for (std::int64_t j = 0; j < n; ++j) sum += std::exp(score[j] - mx);
        const double lse = mx + std::log(sum);
        r.lse[(b * c.hq + h) * c.t + i] = lse;
        for (std::int64_t j = 0; j < n; ++j) prob[j] = std::exp(score[j] - lse);
        for (std::int64_t d = 0; d < c.d; ++d) {
          double o = 0;
          for (std::int64_t j = 0; j < n; ++j) o += prob[j] * problem::at(p.v, b, j, hk, d);
          r.out[qi(b, i, h, d)] = o;
        }
        // Backward of this query row.
        double di = 0;
        for (std::int64_t d = 0; d < c.d; ++d)
          di += problem::at(p.dout, b, i, h, d) * r.out[qi(b, i, h, d)];
        for (std::int64_t j = 0; j < n; ++j) {
          double dp = 0;
          for (std::int64_t d = 0; d < c.d; ++d)
            dp += problem::at(p.dout, b, i, h, d) * problem::at(p.v, b, j, hk, d);
          dprob[j] = prob[j] * (dp - di);  // dS
          for (std::int64_t d = 0; d < c.d; ++d) {
            r.dv[ki(b, j, hk, d)] += prob[j] * problem::at(p.dout, b, i, h, d);
            r.dk[ki(b, j, hk, d)] += scale * dprob[j] * problem::at(p.q, b, i, h, d);
            r.dq[qi(b, i, h, d)] += scale * dprob[j] * problem::at(p.k, b, j, hk, d);
          }
        }
      }
    }
  return r;
}

// max |got - want| <= tol * max(max |want|, 1) over one [B, L, H, D] tensor. The inputs are O(1),
// so every output is a sum of O(1) terms; one that cancels to zero (with a single visible key, dq
// and dk are exactly 0) is held to that absolute scale.
void compare(const char* what, const tensor& got, const std::vector<double>& want, double tol) {
  double scale = 0, worst = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  std::int64_t i = 0;
  for (std::int64_t b = 0; b < got.size(0); ++b)
    for (std::int64_t t = 0; t < got.size(1); ++t)
      for (std::int64_t h = 0; h < got.size(2); ++h)
        for (std::int64_t d = 0; d < got.size(3); ++d, ++i) {
          const double e = std::abs(problem::at(got, b, t, h, d) - want[i]);
          worst = std::isnan(e) ? std::numeric_limits<double>::infinity() : std::max(worst, e);
        }
  INFO(what << ": max error " << worst << " against max magnitude " << scale);
  REQUIRE(worst <= tol * std::max(scale, 1.0));
}

void check(const config& c, dtype t) {
  INFO("B " << c.b << " T " << c.t << " S " << c.s << " Hq " << c.hq << " Hkv " << c.hkv << " D "
            << c.d << (c.causal ? " causal " : " full ") << dtype_name(t));
  problem p(c, t);
  ops::attention_options opt;
  opt.causal = c.causal;
  ops::attention(p.q, p.k, p.v, p.out, p.lse, opt);
  ops::attention_backward(p.q, p.k, p.v, p.out, p.dout, p.lse, p.dq, p.dk, p.dv, opt);
  const reference r = naive(p);
  // f64: every step is a double operation; errors are ~1e-15 times the sizes involved. f32: sums
  // of up to S terms of float products and a float exp2 good to ~1 ulp, so ~1e-6 relative.
  const double tol = t == dtype::f64 ? 1e-10 : 1e-4;
  compare("out", p.out, r.out, tol);
  compare("lse", p.lse.reshape({c.b, c.hq, c.t, 1}), r.lse, tol);
  compare("dq", p.dq, r.dq, tol);
  compare("dk", p.dk, r.dk, tol);
  compare("dv", p.dv, r.dv, tol);
}

const config configs[] = {
    {1, 1, 1, 1, 1, 16, true},       // one query, one key
    {2, 37, 37, 4, 2, 16, true},     // GQA, fused qkv, odd T
    {1, 130, 130, 2, 2, 64, false},  // full attention across three tiles
    {1, 130, 130, 4, 1, 64, true},   // all query heads share one kv head
    {2, 37, 100, 4, 1, 16, true},    // more keys than queries: causal offset S - T
    {1, 70, 130, 3, 3, 64, false},   // S > T without a mask
    {1, 1, 77, 2, 1, 64, true},      // decoding one token against a cache
    {1, 65, 65, 2, 2, 20, true},     // D not a multiple of the vector width
    {1, 9, 12, 2, 1, 3, true},       // tiny D
};

}  // namespace

TEST_CASE("attention matches a naive reference in f64", "[cpu]") {
  for (const config& c : configs) check(c, dtype::f64);
}

TEST_CASE("attention matches a naive reference in f32", "[cpu]") {
  for (const config& c : configs) check(c, dtype::f32);
}

TEST_CASE("attention scratch does not grow with the sequence length", "[cpu]") {
  // Memory linear in T: the inputs are O(T D), the scratch O(tile * D) per thread. A T x T score
  // matrix at T = 2048 would be 16 MiB per head.
  std::size_t scratch_at[2] = {};
  const std::int64_t lengths[2] = {1024, 2048};
  for (int n = 0; n < 2; ++n) {
    const std::int64_t t = lengths[n];
    problem p({1, t, t, 2, 2, 64, true}, dtype::f32);
    memory::reset_peak(memory::tier::host);
    const std::int64_t before = memory::stats(memory::tier::host).in_use;
    ops::attention(p.q, p.k, p.v, p.out, p.lse);
    ops::attention_backward(p.q, p.k, p.v, p.out, p.dout, p.lse, p.dq, p.dk, p.dv);
    const std::int64_t grown = memory::stats(memory::tier::host).peak - before;
    scratch_at[n] = cpu::attention_scratch_bytes();
    INFO("T " << t << ": host peak grew by " << grown << " bytes, scratch held " << scratch_at[n]
              << " bytes");
    // Whatever the call allocated is scratch it keeps; nothing temporary, nothing T x T.
    REQUIRE(grown <= static_cast<std::int64_t>(scratch_at[n]));
    REQUIRE(scratch_at[n] <= static_cast<std::size_t>(parallel::num_threads()) *
                                 cpu::attention_scratch_bytes_per_thread(64, dtype::f64));
    REQUIRE(scratch_at[n] < static_cast<std::size_t>(t * t * 4) / 4);  // a quarter of one head's
  }
  REQUIRE(scratch_at[0] == scratch_at[1]);
  REQUIRE(cpu::attention_scratch_bytes_per_thread(64, dtype::f32) < 256 * 1024);  // fits L2
}

TEST_CASE("attention rejects bad arguments with clear errors", "[cpu]") {
  auto q = zeros({1, 4, 3, 8}), kv = zeros({1, 4, 2, 8}), out = zeros({1, 4, 3, 8}),
       lse = zeros({1, 3, 4});
  REQUIRE_THROWS_WITH(ops::attention(q, kv, kv, out, lse), Catch::Contains("multiple"));
  auto k_short = zeros({1, 2, 3, 8}), lse_bad = zeros({1, 4, 3});
  REQUIRE_THROWS_WITH(ops::attention(q, k_short, k_short, out, lse), Catch::Contains("fewer keys"));
  auto k3 = zeros({1, 4, 3, 8});
  REQUIRE_THROWS_WITH(ops::attention(q, k3, k3, out, lse_bad), Catch::Contains("lse must be"));
  auto q16 = zeros({1, 4, 3, 8}, dtype::bf16), k16 = zeros({1, 4, 3, 8}, dtype::bf16),
       o16 = zeros({1, 4, 3, 8}, dtype::bf16), l64 = zeros({1, 3, 4}, dtype::f64);
  REQUIRE_THROWS_WITH(ops::attention(q16, k16, k16, o16, l64),
                      Catch::Contains("lse has dtype f64 but q has bf16"));
  REQUIRE_THROWS_WITH(ops::attention(q16, k16, k16, out, lse),
                      Catch::Contains("out has dtype f32 but q has bf16"));
}
