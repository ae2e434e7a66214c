// Tests of the tensor-core attention kernels (attention_mma.cu): bf16 and f16, head dimensions 64
// and 128, against the CPU kernel in f32 on the same (16-bit) values, for the output, the lse and
// every gradient; causal and not, grouped-query heads, T != S, sizes that are not multiples of the
// 64-row tiles, strided views (a fused qkv buffer, k and v stored head-major, rows that are not
// 16-byte aligned); and which kernel attention dispatches to. All [gpu] (skipped without a GPU)
// but the cpu dispatch and a host model of the kernel's roundings that checks the bounds.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tensor/cuda/test_bounds.hpp"
#include "tensor/cuda/test_util.hpp"
#include "tensor/ops.hpp"

namespace {

using namespace troupe;
using namespace troupe::cuda_test;

owned_tensor gpu_empty(const shape& s, dtype t) {
  return empty(s, t, device::cuda());
}
owned_tensor f32_host(const tensor& x) {
  owned_tensor h = host(x);
  owned_tensor out = empty(h.sizes(), dtype::f32);
  ops::copy(h, out);
  return out;
}
owned_tensor random16(const shape& s, std::uint32_t seed, dtype t) {
  return rounded(random(s, seed), t);
}

// How q, k and v (and their gradients) are stored.
enum class storage {
  fused,       // views of one [B, T, Hq + 2 Hkv, D] buffer (T == S): the layers' fused qkv
  head_major,  // q contiguous; k and v stored [B, Hkv, S, D] and viewed [B, S, Hkv, D]
  unaligned,   // each in a [B, L, H, D + 1] buffer, elements 1..D: rows not 16-byte aligned
};

struct mma_case {
  std::int64_t B, T, S, Hq, Hkv, D;
  bool causal;
  storage store;
};

struct qkv {
  owned_tensor q_store, k_store, v_store;
  tensor q, k, v;
};
qkv make_qkv(const mma_case& c, std::uint32_t seed, dtype t, bool on_gpu) {
  qkv r;
  auto place = [&](const shape& s, std::uint32_t sd) {
    owned_tensor h = random16(s, sd, t);
    return on_gpu ? gpu(to_16bit(h, t)) : std::move(h);
  };
  switch (c.store) {
    case storage::fused:
      r.q_store = place({c.B, c.T, c.Hq + 2 * c.Hkv, c.D}, seed);
      r.q = r.q_store.narrow(2, 0, c.Hq);
      r.k = r.q_store.narrow(2, c.Hq, c.Hkv);
      r.v = r.q_store.narrow(2, c.Hq + c.Hkv, c.Hkv);
      break;
    case storage::head_major:
      r.q_store = place({c.B, c.T, c.Hq, c.D}, seed);
      r.k_store = place({c.B, c.Hkv, c.S, c.D}, seed + 1);
      r.v_store = place({c.B, c.Hkv, c.S, c.D}, seed + 2);
      r.q = r.q_store.view();
      r.k = r.k_store.transpose(1, 2);
      r.v = r.v_store.transpose(1, 2);
      break;
    case storage::unaligned:
      r.q_store = place({c.B, c.T, c.Hq, c.D + 1}, seed);
      r.k_store = place({c.B, c.S, c.Hkv, c.D + 1}, seed + 1);
      r.v_store = place({c.B, c.S, c.Hkv, c.D + 1}, seed + 2);
      r.q = r.q_store.narrow(3, 1, c.D);
      r.k = r.k_store.narrow(3, 1, c.D);
      r.v = r.v_store.narrow(3, 1, c.D);
      break;
  }
  return r;
}

// The bound on |tensor-core kernel - cpu kernel| per element, before the outputs' own rounding
// to 16 bits (stored_as adds that):
// 1. attention_bound's f32 bound (both sides' f32 roundings; the backward reads the device's
//    16-bit out and lse), doubled: the products of 16-bit inputs are exact in f32, but an MMA may
//    add them with truncation after aligning to the largest term (at most 2u per addition, where
//    attention_bound counts u for the device). The device's tiles of 64 keys rescale less often
//    than attention_bound's 32, so its rescaling terms stay an overestimate.
// 2. The kernels' own roundings of P (before P V and P^T dout) and dS (before dS K and dS^T Q)
//    to 16 bits: half a 16-bit ulp (r16) of the value the device computed, plus half of f16's
//    subnormal spacing (a, absolute: the unnormalized P of the forward is at most 1 and only
//    shrinks by the rescaling, and l >= 1). The device's P is within 10% of the exact p (its
//    error is dominated by the 16-bit lse it reads: r16 |lse| <= 0.08 with |lse| <= 40, checked
//    below; the f32 terms are under 1e-3), so a rounding of P errs by at most 1.1 r16 p + a.
//    The device's dS = P (dP - delta) errs by at most 0.1 |ds| + p (err(dP) + err(delta)):
//    err(dP) <= (D + 1) u sum |dout v| < 1e-4 of it (D <= 128), and delta reads the device's
//    16-bit out, off the exact o by at most (2 r16 + 1e-3) sum_s p |v| + a sum_s |v| per element.
//    Each product then carries these roundings times the other factor's magnitude, summed.
attention_bounds mma_bound(const tensor& q, const tensor& k, const tensor& v, const tensor& dout,
                           bool causal, dtype t, dtype lse_type) {
  attention_bounds r = attention_bound(q, k, v, dout, causal, 0.0, true, t, lse_type);
  for (auto* x : {&r.out, &r.lse, &r.dq, &r.dk, &r.dv})
    for (double& e : *x) e *= 2;
  const std::int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const std::int64_t S = k.size(1), Hkv = k.size(2), group = Hq / Hkv, off = S - T;
  const double scale = 1 / std::sqrt(static_cast<double>(D));
  const double r16 = 0.5 * ulp16(t), a = t == dtype::f16 ? 0x1p-25 : 0.0;
  auto at = [](const tensor& x, std::int64_t b, std::int64_t i, std::int64_t h, std::int64_t d) {
    return static_cast<double>(
        x.data_as<float>()[b * x.stride(0) + i * x.stride(1) + h * x.stride(2) + d * x.stride(3)]);
  };
  auto qi = [&](std::int64_t b, std::int64_t i, std::int64_t h, std::int64_t d) {
    return static_cast<std::size_t>(((b * T + i) * Hq + h) * D + d);
  };
  auto ki = [&](std::int64_t b, std::int64_t j, std::int64_t h, std::int64_t d) {
    return static_cast<std::size_t>(((b * S + j) * Hkv + h) * D + d);
  };
  std::vector<double> score(S), prob(S), mo(D), sv(D);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t hk = h / group;
      for (std::int64_t i = 0; i < T; ++i) {
        const std::int64_t n = causal ? std::min(S, i + off + 1) : S;
        double mx = -INFINITY;
        for (std::int64_t j = 0; j < n; ++j) {
          double sc = 0;
          for (std::int64_t d = 0; d < D; ++d) sc += at(q, b, i, h, d) * at(k, b, j, hk, d);
          score[j] = sc * scale, mx = std::max(mx, score[j]);
        }
        double sum = 0;
        for (std::int64_t j = 0; j < n; ++j) sum += std::exp(score[j] - mx);
        const double lse = mx + std::log(sum);
        REQUIRE(std::abs(lse) <= 40);  // the 10% above
        for (std::int64_t j = 0; j < n; ++j) prob[j] = std::exp(score[j] - lse);
        double di = 0, di_err = 0;
        for (std::int64_t d = 0; d < D; ++d) {
          double o = 0;
          mo[d] = sv[d] = 0;
          for (std::int64_t j = 0; j < n; ++j) {
            o += prob[j] * at(v, b, j, hk, d);
            mo[d] += prob[j] * std::abs(at(v, b, j, hk, d));
            sv[d] += std::abs(at(v, b, j, hk, d));
          }
          const double g = std::abs(at(dout, b, i, h, d));
          di += at(dout, b, i, h, d) * o;
          di_err += g * ((2 * r16 + 1e-3) * mo[d] + a * sv[d]);
          r.out[qi(b, i, h, d)] += 1.1 * r16 * mo[d] + a * sv[d];  // P rounded before P V
        }
        for (std::int64_t j = 0; j < n; ++j) {
          double dp = 0, adp = 0;
          for (std::int64_t d = 0; d < D; ++d) {
            dp += at(dout, b, i, h, d) * at(v, b, j, hk, d);
            adp += std::abs(at(dout, b, i, h, d) * at(v, b, j, hk, d));
          }
          const double ds = prob[j] * (dp - di);
          const double ds_dev = 1.1 * std::abs(ds) + 1.1 * prob[j] * (1e-4 * adp + di_err);
          const double ds_round = r16 * ds_dev + a;        // dS rounded before dS K and dS^T Q
          const double p_round = 1.1 * r16 * prob[j] + a;  // P rounded before P^T dout
          for (std::int64_t d = 0; d < D; ++d) {
            r.dv[ki(b, j, hk, d)] += p_round * std::abs(at(dout, b, i, h, d));
            r.dk[ki(b, j, hk, d)] += scale * ds_round * std::abs(at(q, b, i, h, d));
            r.dq[qi(b, i, h, d)] += scale * ds_round * std::abs(at(k, b, j, hk, d));
          }
        }
      }
    }
  return r;
}

std::string describe(const mma_case& c) {
  const char* st[] = {"fused", "head-major", "unaligned"};
  return "B " + std::to_string(c.B) + " T " + std::to_string(c.T) + " S " + std::to_string(c.S) +
         " Hq " + std::to_string(c.Hq) + " Hkv " + std::to_string(c.Hkv) + " D " +
         std::to_string(c.D) + (c.causal ? " causal " : " full ") + st[static_cast<int>(c.store)];
}

// Compares the gradients with the bounds placed in the layout of their storage (dq, dk and dv
// share one buffer when fused).
void check_gradients(const mma_case& c, const qkv& got, const qkv& want, const attention_bounds& ab,
                     dtype t) {
  std::vector<double> qb, kb, vb;
  const bool fused = c.store == storage::fused;
  place(qb, want.q_store, want.q, ab.dq);
  place(fused ? qb : kb, fused ? want.q_store : want.k_store, want.k, ab.dk);
  place(fused ? qb : vb, fused ? want.q_store : want.v_store, want.v, ab.dv);
  // Elements outside the views (element 0 of each unaligned row) get bound 0: both sides must
  // leave the buffers' values there as they were.
  require_within(got.q_store, want.q_store, stored_as(t, qb, want.q_store),
                 fused ? "dq dk dv" : "dq");
  if (!fused) {
    require_within(got.k_store, want.k_store, stored_as(t, kb, want.k_store), "dk");
    require_within(got.v_store, want.v_store, stored_as(t, vb, want.v_store), "dv");
  }
}

constexpr dtype half_types[] = {dtype::bf16, dtype::f16};

}  // namespace

TEST_CASE("tensor-core attention in bf16 and f16 matches f32 on the rounded inputs", "[gpu]") {
  TROUPE_NEED_GPU();
  const mma_case cases[] = {
      {2, 100, 100, 4, 2, 64, true, storage::fused},        // GQA, T not a tile multiple
      {1, 70, 150, 3, 3, 64, true, storage::head_major},    // causal with offset S - T = 80
      {2, 37, 130, 2, 1, 128, false, storage::head_major},  // full, T != S, GQA
      {1, 129, 129, 2, 1, 128, true, storage::fused},       // one row past two tiles
      {1, 45, 83, 4, 2, 64, true, storage::unaligned},      // element-wise loads, T != S
      {1, 20, 20, 2, 2, 128, false, storage::unaligned},
  };
  for (dtype t : half_types)
    for (dtype lt : {t, dtype::f32})
      for (const mma_case& c : cases) {
        INFO(dtype_name(t) << " lse " << dtype_name(lt) << " " << describe(c));
        ops::attention_options opt;
        opt.causal = c.causal;
        opt.kernel = ops::attention_kernel::tensor_cores;
        qkv h = make_qkv(c, 60, t, false), g = make_qkv(c, 60, t, true);
        REQUIRE(std::string(ops::attention_kernel_for(g.q, opt)) == "cuda tensor cores");
        const shape qshape{c.B, c.T, c.Hq, c.D};
        owned_tensor out = empty(qshape), lse = empty({c.B, c.Hq, c.T});
        owned_tensor gout = gpu_empty(qshape, t), glse = gpu_empty({c.B, c.Hq, c.T}, lt);
        ops::attention(h.q, h.k, h.v, out, lse, opt);
        ops::attention(g.q, g.k, g.v, gout, glse, opt);
        owned_tensor dout = random16(qshape, 61, t), gdout = gpu(to_16bit(dout, t));
        const attention_bounds ab = mma_bound(h.q, h.k, h.v, dout, c.causal, t, lt);
        require_within(gout, out, stored_as(t, ab.out, out), "out");
        require_within(glse, lse, stored_as(lt, ab.lse, lse), "lse");

        // backward from the output and lse the device stored
        qkv hg = make_qkv(c, 70, t, false), gg = make_qkv(c, 70, t, true);  // gradients
        ops::attention_backward(h.q, h.k, h.v, f32_host(gout), dout, f32_host(glse), hg.q, hg.k,
                                hg.v, opt);
        ops::attention_backward(g.q, g.k, g.v, gout, gdout, glse, gg.q, gg.k, gg.v, opt);
        check_gradients(c, gg, hg, ab, t);
      }
}

TEST_CASE("tensor-core attention backward gives the same bits on every run", "[gpu]") {
  TROUPE_NEED_GPU();
  // Every gradient row has one writer and a fixed order of additions: no atomics.
  const mma_case c{2, 150, 150, 4, 1, 64, true, storage::fused};
  const dtype t = dtype::bf16;
  ops::attention_options opt;
  opt.kernel = ops::attention_kernel::tensor_cores;
  qkv g = make_qkv(c, 80, t, true);
  const shape qshape{c.B, c.T, c.Hq, c.D};
  owned_tensor gout = gpu_empty(qshape, t), glse = gpu_empty({c.B, c.Hq, c.T}, dtype::f32);
  ops::attention(g.q, g.k, g.v, gout, glse, opt);
  owned_tensor gdout = gpu(to_16bit(random16(qshape, 81, t), t));
  qkv first = make_qkv(c, 90, t, true), second = make_qkv(c, 91, t, true);
  ops::attention_backward(g.q, g.k, g.v, gout, gdout, glse, first.q, first.k, first.v, opt);
  ops::attention_backward(g.q, g.k, g.v, gout, gdout, glse, second.q, second.k, second.v, opt);
  require_close(second.q_store, first.q_store, 0, 0, "dq dk dv of two runs");
}

TEST_CASE("attention takes tensor cores for 16-bit head dims 64 and 128 only", "[gpu]") {
  TROUPE_NEED_GPU();
  auto kernel = [](dtype t, std::int64_t d, ops::attention_kernel k) {
    owned_tensor q = gpu_empty({1, 4, 2, d}, t);
    ops::attention_options opt;
    opt.kernel = k;
    return std::string(ops::attention_kernel_for(q, opt));
  };
  const auto tc = ops::attention_kernel::tensor_cores;
  for (dtype t : half_types)
    for (std::int64_t d : {64, 128}) {
      INFO(dtype_name(t) << " D " << d);
      // the check's GPUs (H100, H200) are sm_90
      CHECK(kernel(t, d, tc) == "cuda tensor cores");
      CHECK(kernel(t, d, ops::attention_kernel::cuda_cores) == "cuda cores");
      // automatic stays on the CUDA cores until these kernels have passed on a GPU (ops.hpp)
      CHECK(kernel(t, d, ops::attention_kernel::automatic) == "cuda cores");
    }
  for (std::int64_t d : {16, 32, 72, 96, 112}) CHECK(kernel(dtype::bf16, d, tc) == "cuda cores");
  CHECK(kernel(dtype::f32, 64, tc) == "cuda cores");
  CHECK(kernel(dtype::f32, 128, tc) == "cuda cores");
}

TEST_CASE("attention on the cpu reports the cpu kernel", "[cpu]") {
  owned_tensor q = empty({1, 4, 2, 64}, dtype::bf16);
  CHECK(std::string(ops::attention_kernel_for(q)) == "cpu");
}

namespace {

float round16(float x, dtype t) {
  return t == dtype::bf16 ? bf16_bits_to_f32(f32_to_bf16_bits(x))
                          : f16_bits_to_f32(f32_to_f16_bits(x));
}

// A host model of attention_mma.cu's arithmetic (not of its speed, and with round-to-nearest f32
// sums where an MMA may truncate): the same 64-key tiles per 64-query block, the online softmax
// in f32, P rounded to t before P V, the lse as m + log l, then in the backward delta from the
// 16-bit out, P and dS recomputed from the 16-bit lse and rounded to t before their products,
// each result rounded once. Inputs and results are f32 host tensors [B, L, H, D] (contiguous)
// holding t values. It runs here, without a GPU, to check that mma_bound covers these roundings;
// it proves nothing about the kernel itself.
struct emulated {
  owned_tensor out, lse, dq, dk, dv;
};
emulated emulate_mma(const tensor& q, const tensor& k, const tensor& v, const tensor& dout,
                     bool causal, dtype t, dtype lt) {
  const std::int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const std::int64_t S = k.size(1), Hkv = k.size(2), group = Hq / Hkv, off = S - T;
  const float scale = static_cast<float>(1 / std::sqrt(static_cast<double>(D)));
  auto at = [](const tensor& x, std::int64_t b, std::int64_t i, std::int64_t h, std::int64_t d) {
    return x.data_as<float>()[((b * x.size(1) + i) * x.size(2) + h) * x.size(3) + d];
  };
  auto visible = [&](std::int64_t i, std::int64_t j) { return !causal || j <= i + off; };
  auto dot = [&](const tensor& a, std::int64_t b, std::int64_t i, std::int64_t h, const tensor& c,
                 std::int64_t j, std::int64_t hc) {
    float s = 0;
    for (std::int64_t d = 0; d < D; ++d) s += at(a, b, i, h, d) * at(c, b, j, hc, d);
    return s;
  };
  emulated r{zeros({B, T, Hq, D}), zeros({B, Hq, T}), zeros({B, T, Hq, D}), zeros({B, S, Hkv, D}),
             zeros({B, S, Hkv, D})};
  std::vector<float> o(D), pv(D), acc(D), acc2(D);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t hk = h / group;
      for (std::int64_t i = 0; i < T; ++i) {
        const std::int64_t last = std::min((i / 64 + 1) * 64, T) - 1;  // the block's last row
        const std::int64_t s_end = causal ? std::min(S, last + off + 1) : S;
        float m = -INFINITY, l = 0;
        std::fill(o.begin(), o.end(), 0.0f);
        for (std::int64_t s0 = 0; s0 < s_end; s0 += 64) {
          const std::int64_t s1 = std::min(s0 + 64, S);
          float mx = -INFINITY;
          for (std::int64_t j = s0; j < s1; ++j)
            if (visible(i, j)) mx = std::max(mx, dot(q, b, i, h, k, j, hk) * scale);
          const float m_new = std::max(m, mx);
          const float corr = m_new == -INFINITY ? 1.0f : std::exp(m - m_new);
          float sum = 0;
          std::fill(pv.begin(), pv.end(), 0.0f);
          for (std::int64_t j = s0; j < s1; ++j) {
            if (!visible(i, j) || m_new == -INFINITY) continue;
            const float e = std::exp(dot(q, b, i, h, k, j, hk) * scale - m_new);
            sum += e;
            const float pr = round16(e, t);
            for (std::int64_t d = 0; d < D; ++d) pv[d] += pr * at(v, b, j, hk, d);
          }
          l = l * corr + sum;
          m = m_new;
          for (std::int64_t d = 0; d < D; ++d) o[d] = o[d] * corr + pv[d];
        }
        for (std::int64_t d = 0; d < D; ++d)
          r.out.data_as<float>()[((b * T + i) * Hq + h) * D + d] = round16(o[d] / l, t);
        const float lse = m + std::log(l);
        r.lse.data_as<float>()[(b * Hq + h) * T + i] = lt == dtype::f32 ? lse : round16(lse, lt);
      }
    }
  auto lse_at = [&](std::int64_t b, std::int64_t h, std::int64_t i) {
    return r.lse.data_as<float>()[(b * Hq + h) * T + i];
  };
  auto delta = [&](std::int64_t b, std::int64_t h, std::int64_t i) {
    float s = 0;
    for (std::int64_t d = 0; d < D; ++d) s += at(dout, b, i, h, d) * at(r.out, b, i, h, d);
    return s;
  };
  auto p_ds = [&](std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j, float di,
                  float& pr, float& ds) {
    const std::int64_t hk = h / group;
    pr = std::exp(dot(q, b, i, h, k, j, hk) * scale - lse_at(b, h, i));
    ds = round16(pr * (dot(dout, b, i, h, v, j, hk) - di), t);
    pr = round16(pr, t);
  };
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < T; ++i) {
        const float di = delta(b, h, i);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (std::int64_t j = 0; j < S; ++j) {
          if (!visible(i, j)) continue;
          float pr, ds;
          p_ds(b, h, i, j, di, pr, ds);
          for (std::int64_t d = 0; d < D; ++d) acc[d] += ds * at(k, b, j, h / group, d);
        }
        for (std::int64_t d = 0; d < D; ++d)
          r.dq.data_as<float>()[((b * T + i) * Hq + h) * D + d] = round16(acc[d] * scale, t);
      }
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t hk = 0; hk < Hkv; ++hk)
      for (std::int64_t j = 0; j < S; ++j) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        std::fill(acc2.begin(), acc2.end(), 0.0f);
        for (std::int64_t g = 0; g < group; ++g) {
          const std::int64_t h = hk * group + g;
          for (std::int64_t i = 0; i < T; ++i) {
            if (!visible(i, j)) continue;
            float pr, ds;
            p_ds(b, h, i, j, delta(b, h, i), pr, ds);
            for (std::int64_t d = 0; d < D; ++d) {
              acc[d] += ds * at(q, b, i, h, d);
              acc2[d] += pr * at(dout, b, i, h, d);
            }
          }
        }
        for (std::int64_t d = 0; d < D; ++d) {
          r.dk.data_as<float>()[((b * S + j) * Hkv + hk) * D + d] = round16(acc[d] * scale, t);
          r.dv.data_as<float>()[((b * S + j) * Hkv + hk) * D + d] = round16(acc2[d], t);
        }
      }
  return r;
}

}  // namespace

TEST_CASE("a host model of the tensor-core kernel's roundings stays within its test bounds",
          "[cpu]") {
  // Runs without a GPU: the bounds of the [gpu] test above must hold for the kernel's arithmetic
  // even where every rounding it adds goes the worst way it can on these inputs.
  for (dtype t : half_types)
    for (const mma_case& c : {mma_case{1, 70, 150, 2, 1, 64, true, storage::head_major},
                              mma_case{1, 37, 80, 2, 2, 128, false, storage::head_major}}) {
      INFO(dtype_name(t) << " " << describe(c));
      const dtype lt = t;  // the coarser lse
      const shape qs{c.B, c.T, c.Hq, c.D}, ks{c.B, c.S, c.Hkv, c.D};
      owned_tensor q = random16(qs, 1, t), k = random16(ks, 2, t), v = random16(ks, 3, t);
      owned_tensor dout = random16(qs, 4, t);
      ops::attention_options opt;
      opt.causal = c.causal;
      const emulated e = emulate_mma(q, k, v, dout, c.causal, t, lt);
      owned_tensor out = empty(qs), lse = empty({c.B, c.Hq, c.T});
      ops::attention(q, k, v, out, lse, opt);
      const attention_bounds ab = mma_bound(q, k, v, dout, c.causal, t, lt);
      require_within(e.out, out, stored_as(t, ab.out, out), "out");
      require_within(e.lse, lse, stored_as(lt, ab.lse, lse), "lse");
      owned_tensor dq = empty(qs), dk = empty(ks), dv = empty(ks);
      ops::attention_backward(q, k, v, e.out, dout, e.lse, dq, dk, dv, opt);
      require_within(e.dq, dq, stored_as(t, ab.dq, dq), "dq");
      require_within(e.dk, dk, stored_as(t, ab.dk, dk), "dk");
      require_within(e.dv, dv, stored_as(t, ab.dv, dv), "dv");
    }
}
