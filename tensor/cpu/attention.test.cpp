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
  owned_tensor seg;  // packed rows: segment ids i32 [B, T], or undefined
  bool visible(std::int64_t b, std::int64_t i, std::int64_t j) const {
    if (!seg.defined()) return true;
    const auto* p = seg.data_as<std::int32_t>() + b * c.t;
    return p[i] == p[j];
  }

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

// The reference, all in double: [B, L, H, D] arrays laid out contiguously, and beside each value a
// bound on how far a kernel computing in T (unit roundoff u) may be from it (below).
struct reference {
  std::vector<double> out, lse, dq, dk, dv;
  std::vector<double> out_bound, lse_bound, dq_bound, dk_bound, dv_bound;
};

// Error bounds, first order in u, that hold for any order of every sum, so for either tile kernel
// (AVX2 or AVX-512, picked by the CPU) and any thread split: a sum of n terms errs by at most
// n u sum |terms|, any other operation by u times its result. With a_j = scale sum_d |q_d k_jd|:
// - score j errs by (D + 3) u a_j (q is pre-multiplied by scale log2 e, then D products and sums);
//   exp(s_j - m) then errs relatively by that, by u |s_j - m| (the rounded difference) and by
//   c_exp u (the f32 exp2 polynomial is good to 2e-7 = 3.4 u, std::exp2 to an ulp);
// - the running sum and the output are rescaled once per 64-key tile (attention.cpp's block_k),
//   and add n terms: out errs by (relative error of p_j / l + (n + 2 tiles) u) sum_j w_j |v_jd|;
// - backward recomputes P from the stored lse (whose error adds to every score's), forms
//   rowsum(dO * O) from the kernel's O (its bound above enters) and dS = P (dP - rowsum), then sums
//   dS K over the n keys and dS^T Q, P^T dO over the queries of the group.
// check() doubles the bounds for second-order terms. The inputs are O(1), so the bounds are ~1e-5
// to 1e-4 in f32 while a wrong kernel (a key too many or too few, a wrong head or scale) is off by
// O(0.1): dropping one key fails by 2e6 times the bound, a scale 0.1% off by 100 times.
constexpr double c_exp = 4;

template <class T>
reference naive(const problem& p) {
  const double u = std::is_same_v<T, float> ? 0x1p-24 : 0x1p-53;
  const config& c = p.c;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const std::int64_t group = c.hq / c.hkv, off = c.s - c.t;
  reference r;
  r.out.assign(c.b * c.t * c.hq * c.d, 0.0);
  r.dq.assign(c.b * c.t * c.hq * c.d, 0.0);
  r.lse.assign(c.b * c.hq * c.t, 0.0);
  r.dk.assign(c.b * c.s * c.hkv * c.d, 0.0);
  r.dv.assign(c.b * c.s * c.hkv * c.d, 0.0);
  r.out_bound = r.dq_bound = r.out;
  r.lse_bound = r.lse;
  r.dk_bound = r.dv_bound = r.dk;
  auto qi = [&](std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t d) {
    return ((b * c.t + t) * c.hq + h) * c.d + d;
  };
  auto ki = [&](std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d) {
    return ((b * c.s + s) * c.hkv + h) * c.d + d;
  };
  // Terms of a dk or dv element: at most every query of every head of the group.
  const double nk = static_cast<double>(group * c.t);
  std::vector<double> score(c.s), mag(c.s), prob(c.s), dprob(c.s);
  for (std::int64_t b = 0; b < c.b; ++b)
    for (std::int64_t h = 0; h < c.hq; ++h) {
      const std::int64_t hk = h / group;
      for (std::int64_t i = 0; i < c.t; ++i) {
        const std::int64_t n = c.causal ? std::min(c.s, i + off + 1) : c.s;  // visible keys
        const double tiles = static_cast<double>((n + 63) / 64);
        double mx = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < n; ++j) {
          if (!p.visible(b, i, j)) {  // another segment: weight 0, no error
            score[j] = -std::numeric_limits<double>::infinity();
            mag[j] = 0;
            continue;
          }
          double s = 0, a = 0;
          for (std::int64_t d = 0; d < c.d; ++d) {
            s += problem::at(p.q, b, i, h, d) * problem::at(p.k, b, j, hk, d);
            a += std::abs(problem::at(p.q, b, i, h, d) * problem::at(p.k, b, j, hk, d));
          }
          score[j] = s * scale;
          mag[j] = a * scale;
          mx = std::max(mx, score[j]);
        }
        double sum = 0;
        for (std::int64_t j = 0; j < n; ++j) sum += std::exp(score[j] - mx);
        const double lse = mx + std::log(sum);
        const std::int64_t li = (b * c.hq + h) * c.t + i;
        r.lse[li] = lse;
        for (std::int64_t j = 0; j < n; ++j) prob[j] = std::exp(score[j] - lse);
        // Forward: the largest relative error of a p_j (a rescale moves the running max by at
        // most the spread of the scores), then of a weight p_j / l.
        double dp_max = 0;
        for (std::int64_t j = 0; j < n; ++j)
          if (p.visible(b, i, j))
            dp_max =
                std::max(dp_max, (c.d + 3) * u * mag[j] +
                                     (tiles + 2) * u * std::abs(score[j] - mx) + u * std::abs(mx));
        const double dw = 2 * dp_max + ((tiles + 2) * c_exp + n + 4) * u;
        r.lse_bound[li] = dp_max + ((tiles + 1) * c_exp + n + 2) * u + u * std::abs(lse);
        for (std::int64_t d = 0; d < c.d; ++d) {
          double o = 0, mo = 0;
          for (std::int64_t j = 0; j < n; ++j) {
            o += prob[j] * problem::at(p.v, b, j, hk, d);
            mo += prob[j] * std::abs(problem::at(p.v, b, j, hk, d));
          }
          r.out[qi(b, i, h, d)] = o;
          r.out_bound[qi(b, i, h, d)] = (dw + (n + 2 * tiles + 2) * u) * mo;
        }
        // Backward of this query row. di is formed from the kernel's out: its error enters too.
        double di = 0, di_err = 0;
        for (std::int64_t d = 0; d < c.d; ++d) {
          const double g = problem::at(p.dout, b, i, h, d), o = r.out[qi(b, i, h, d)];
          di += g * o;
          di_err += std::abs(g) * r.out_bound[qi(b, i, h, d)] + (c.d + 1) * u * std::abs(g * o);
        }
        for (std::int64_t j = 0; j < n; ++j) {
          if (!p.visible(b, i, j)) continue;
          double dp = 0, adp = 0;
          for (std::int64_t d = 0; d < c.d; ++d) {
            const double t = problem::at(p.dout, b, i, h, d) * problem::at(p.v, b, j, hk, d);
            dp += t;
            adp += std::abs(t);
          }
          dprob[j] = prob[j] * (dp - di);  // dS
          // Relative error of the recomputed P, and the error of dS.
          const double rho = (c.d + 3) * u * mag[j] + r.lse_bound[li] +
                             u * (std::abs(score[j] - lse) + 2 * std::abs(lse)) + c_exp * u;
          const double ds_err = (rho + 2 * u) * std::abs(dprob[j]) +
                                prob[j] * ((c.d + 1) * u * adp + di_err + u * std::abs(dp - di));
          for (std::int64_t d = 0; d < c.d; ++d) {
            const double qv = problem::at(p.q, b, i, h, d), kv = problem::at(p.k, b, j, hk, d),
                         g = problem::at(p.dout, b, i, h, d);
            r.dv[ki(b, j, hk, d)] += prob[j] * g;
            r.dk[ki(b, j, hk, d)] += scale * dprob[j] * qv;
            r.dq[qi(b, i, h, d)] += scale * dprob[j] * kv;
            r.dv_bound[ki(b, j, hk, d)] += (rho + (nk + 2) * u) * prob[j] * std::abs(g);
            r.dk_bound[ki(b, j, hk, d)] +=
                scale * (ds_err + (nk + 3) * u * std::abs(dprob[j])) * std::abs(qv);
            r.dq_bound[qi(b, i, h, d)] +=
                scale * (ds_err + (n + 3) * u * std::abs(dprob[j])) * std::abs(kv);
          }
        }
      }
    }
  return r;
}

// Every |got - want| <= factor * bound, elementwise over one [B, L, H, D] tensor (NaN fails).
void compare(const char* what, const tensor& got, const std::vector<double>& want,
             const std::vector<double>& bound, double factor) {
  double worst = 0;  // the largest error / bound
  std::int64_t i = 0, bad = -1;
  for (std::int64_t b = 0; b < got.size(0); ++b)
    for (std::int64_t t = 0; t < got.size(1); ++t)
      for (std::int64_t h = 0; h < got.size(2); ++h)
        for (std::int64_t d = 0; d < got.size(3); ++d, ++i) {
          const double e = std::abs(problem::at(got, b, t, h, d) - want[i]);
          const double lim = factor * bound[i];
          if (!(e <= lim) && bad < 0) bad = i;
          worst = std::max(worst, std::isnan(e) ? INFINITY : e / std::max(lim, 1e-300));
        }
  INFO(what << ": largest error / bound " << worst);
  if (bad >= 0) INFO("element " << bad << ": want " << want[bad] << " +- " << factor * bound[bad]);
  REQUIRE(bad < 0);
}

// segments: per row, the lengths of its packed segments (summing to T), or empty.
void check(const config& c, dtype t, const std::vector<std::vector<std::int64_t>>& segments = {}) {
  INFO("B " << c.b << " T " << c.t << " S " << c.s << " Hq " << c.hq << " Hkv " << c.hkv << " D "
            << c.d << (c.causal ? " causal " : " full ") << dtype_name(t)
            << (segments.empty() ? "" : " packed"));
  problem p(c, t);
  ops::attention_options opt;
  opt.causal = c.causal;
  if (!segments.empty()) {
    p.seg = empty({c.b, c.t}, dtype::i32);
    auto* s = p.seg.data_as<std::int32_t>();
    for (std::int64_t b = 0; b < c.b; ++b) {
      std::int64_t at = 0;
      std::int32_t id = 0;
      for (std::int64_t len : segments[b]) {
        for (std::int64_t i = 0; i < len; ++i) s[b * c.t + at++] = id;
        ++id;
      }
      REQUIRE(at == c.t);
    }
    opt.segments = p.seg;
  }
  ops::attention(p.q, p.k, p.v, p.out, p.lse, opt);
  ops::attention_backward(p.q, p.k, p.v, p.out, p.dout, p.lse, p.dq, p.dk, p.dv, opt);
  // The bounds (see naive) doubled for second-order terms; in f64 the reference rounds like the
  // kernel (its own error has the same bound), so twice that.
  const reference r = t == dtype::f64 ? naive<double>(p) : naive<float>(p);
  const double factor = t == dtype::f64 ? 4 : 2;
  compare("out", p.out, r.out, r.out_bound, factor);
  compare("lse", p.lse.reshape({c.b, c.hq, c.t, 1}), r.lse, r.lse_bound, factor);
  compare("dq", p.dq, r.dq, r.dq_bound, factor);
  compare("dk", p.dk, r.dk, r.dk_bound, factor);
  compare("dv", p.dv, r.dv, r.dv_bound, factor);
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

TEST_CASE("attention keeps packed segments apart like a masked naive reference", "[cpu]") {
  // Segments that start inside, at and after 64-key tile boundaries (a query block whose later
  // queries see no key of the first tiles it visits), one-token segments, and GQA.
  const std::vector<std::vector<std::int64_t>> rows{{70, 1, 57, 22}, {1, 63, 64, 22}};
  for (dtype t : {dtype::f64, dtype::f32}) {
    check({2, 150, 150, 4, 2, 16, true}, t, rows);
    check({2, 150, 150, 2, 2, 20, false}, t, rows);  // segments alone, no causal mask
  }
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
