// Tests of the bf16 and f16 paths of the CPU matmul and attention: each against the f32 op run on
// the same rounded inputs (half_testing.hpp), on strided views as the layers pass them.
#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "tensor/cpu/attention.hpp"
#include "tensor/cpu/gemm_amx.hpp"
#include "tensor/cpu/half_testing.hpp"
#include "tensor/ops.hpp"
#include "tensor/parallel.hpp"

using namespace troupe;
using namespace troupe::cpu::testing;

namespace {

struct gemm_case {
  std::int64_t m, k, n;
  bool ta, tb;  // a (b) is the transpose of a row-major buffer
};

// The [rows, cols] operand view of a twin: the buffer itself, or the transpose of a [cols, rows]
// buffer.
tensor operand(const tensor& buf, bool transposed) {
  return transposed ? buf.transpose(0, 1) : buf;
}

}  // namespace

// The 16-bit product against SGEMM on the same values, on views like the layers pass.
template <class S>
void check_matmul_cases() {
  rng g(21);
  // Sizes within one block, and beyond the 1024 x 1024 tiles of c and the 512-deep inner blocks.
  const gemm_case cases[] = {{37, 29, 41, false, false},     {37, 29, 41, true, true},
                             {5, 1, 3, false, true},         {1, 700, 1, true, false},
                             {1100, 600, 1030, false, true}, {300, 1300, 90, true, false}};
  for (const auto& [m, k, n, ta, tb] : cases) {
    INFO("m " << m << " k " << k << " n " << n << " ta " << ta << " tb " << tb);
    twin<S> a(ta ? shape{k, m} : shape{m, k}), b(tb ? shape{n, k} : shape{k, n});
    a.uniform(g, -1, 1);
    b.uniform(g, -1, 1);
    // c as the left part of wider rows (ldc > n).
    twin<S> c_buf({m, n + 3});
    const tensor ch = c_buf.h.t.narrow(1, 0, n), cf = c_buf.f.t.narrow(1, 0, n);
    // Bound on the f32 rounding of a k-term dot product summed in any order: k u sum |a b|.
    buffer<float> abs_a(a.f.t.sizes()), abs_b(b.f.t.sizes()), abs_ab({m, n});
    for (std::int64_t i = 0; i < a.size(); ++i) abs_a[i] = std::fabs(a.f[i]);
    for (std::int64_t i = 0; i < b.size(); ++i) abs_b[i] = std::fabs(b.f[i]);
    ops::matmul(operand(abs_a, ta), operand(abs_b, tb), abs_ab);
    for (double beta : {0.0, 0.5}) {
      INFO("beta " << beta);
      c_buf.uniform(g, -1, 1);
      buffer<float> c_old({m, n});
      ops::copy(cf, c_old);
      const double alpha = 0.7;
      ops::matmul(operand(a.h, ta), operand(b.h, tb), ch, alpha, beta);
      ops::matmul(operand(a.f, ta), operand(b.f, tb), cf, alpha, beta);
      buffer<S> got({m, n});
      buffer<float> ref({m, n});
      ops::copy(ch, got);
      ops::copy(cf, ref);
      for (std::int64_t i = 0; i < m * n; ++i) {
        const double r = ref[i], u = 0x1p-24;
        const double slack =
            2 * static_cast<double>(k + 2) * u * (alpha * abs_ab[i] + beta * std::fabs(c_old[i]));
        const double tol = 0.5 * ulp_of<S>(r) + slack;
        if (std::fabs(value_of(got[i]) - r) <= tol) continue;
        INFO("element " << i << ": got " << value_of(got[i]) << ", f32 op gives " << r);
        REQUIRE(std::fabs(value_of(got[i]) - r) <= tol);
      }
      // The columns past n are untouched.
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = n; j < n + 3; ++j)
          REQUIRE(value_of(c_buf.h[i * (n + 3) + j]) == c_buf.f[i * (n + 3) + j]);
    }
  }
}

TEMPLATE_TEST_CASE("16-bit matmul matches f32 SGEMM on the same values", "[cpu]", bf16_t, f16_t) {
  using S = TestType;
  rng g(23);
  check_matmul_cases<S>();
  // An empty inner dimension scales c by beta, rounding once.
  twin<S> c({3, 4});
  c.uniform(g, -2, 2);
  buffer<S> a0({3, 0}), b0({0, 4});
  ops::matmul(a0, b0, c.h, 1.0, 0.3);
  for (std::int64_t i = 0; i < 12; ++i) REQUIRE(c.h[i].bits == round_to<S>(0.3 * c.f[i]).bits);
}

// The default path above is f32 SGEMM on widened panels; this runs the same cases with AMX asked
// for (TROUPE_CPU_AMX=1, gemm_amx.hpp), at 1, 2, 4 and 8 threads: on the lent GPU machine's Xeon
// bf16 training on AMX went wrong from 4 threads on. Where the CPU has no AMX the cases take the
// default path again and the test says it skipped AMX.
TEST_CASE("bf16 matmul on AMX matches f32 SGEMM on the same values at every thread count",
          "[cpu][amx]") {
  const char* old = std::getenv("TROUPE_CPU_AMX");
  const std::string saved = old != nullptr ? old : "";
  const int threads = parallel::num_threads();
  setenv("TROUPE_CPU_AMX", "1", 1);
  if (!cpu::amx_bf16_usable()) WARN("troupe-skip: no AMX on this CPU (the default path ran)");
  for (int n : {1, 2, 4, 8}) {
    INFO(n << " threads");
    parallel::set_num_threads(n);
    check_matmul_cases<bf16_t>();
  }
  parallel::set_num_threads(threads);
  if (old != nullptr) {
    setenv("TROUPE_CPU_AMX", saved.c_str(), 1);
  } else {
    unsetenv("TROUPE_CPU_AMX");
  }
}

namespace {

struct attn_case {
  std::int64_t b, t, s, hq, hkv, d;
  bool causal;
};

}  // namespace

TEMPLATE_TEST_CASE("16-bit attention and its backward match f32 with either lse dtype", "[cpu]",
                   bf16_t, f16_t) {
  using S = TestType;
  rng g(22);
  const attn_case cases[] = {{2, 70, 70, 4, 2, 24, true},
                             {1, 65, 130, 2, 1, 64, true},
                             {1, 40, 100, 3, 3, 13, false},
                             {1, 129, 129, 2, 2, 80, true}};
  for (const auto& [B, T, Sk, Hq, Hkv, D, causal] : cases) {
    INFO("B " << B << " T " << T << " S " << Sk << " Hq " << Hq << " Hkv " << Hkv << " D " << D
              << " causal " << causal);
    // q from a buffer with a spare head, k and v side by side in one buffer: strided views like
    // slices of a fused projection.
    twin<S> qbuf({B, T, Hq + 1, D}), kvbuf({B, Sk, 2 * Hkv, D}), dout({B, T, Hq, D});
    qbuf.uniform(g, -2, 2);
    kvbuf.uniform(g, -2, 2);
    dout.uniform(g, -1, 1);
    auto views = [&](const tensor& qb, const tensor& kvb) {
      return std::array<tensor, 3>{qb.narrow(2, 1, Hq), kvb.narrow(2, 0, Hkv),
                                   kvb.narrow(2, Hkv, Hkv)};
    };
    const auto [qh, kh, vh] = views(qbuf.h, kvbuf.h);
    const auto [qf, kf, vf] = views(qbuf.f, kvbuf.f);
    const ops::attention_options opt{.scale = 0.0, .causal = causal};
    buffer<float> rout({B, T, Hq, D}), rlse({B, Hq, T});
    ops::attention(qf, kf, vf, rout, rlse, opt);
    auto check = [&]<class L>(L) {
      INFO("lse in " << dtype_name(dtype_of<L>));
      buffer<S> out({B, T, Hq, D});
      buffer<L> lse({B, Hq, T});
      ops::attention(qh, kh, vh, out, lse, opt);
      require_ulps(out, rout, 0.5);
      if constexpr (std::is_same_v<L, float>) {
        require_close(lse, std::vector<double>(rlse.v.begin(), rlse.v.end()), 0, 0);
      } else {
        require_ulps(lse, rlse, 0.5);
      }
      // Backward from the stored out and lse, with the same values in f32 for the reference.
      buffer<float> out_f({B, T, Hq, D}), lse_f({B, Hq, T});
      for (std::int64_t i = 0; i < out.size(); ++i) out_f[i] = static_cast<float>(value_of(out[i]));
      for (std::int64_t i = 0; i < lse.size(); ++i) lse_f[i] = static_cast<float>(value_of(lse[i]));
      buffer<S> dq({B, T, Hq, D}), dk({B, Sk, Hkv, D}), dv({B, Sk, Hkv, D});
      buffer<float> rdq({B, T, Hq, D}), rdk({B, Sk, Hkv, D}), rdv({B, Sk, Hkv, D});
      ops::attention_backward(qh, kh, vh, out, dout.h, lse, dq, dk, dv, opt);
      ops::attention_backward(qf, kf, vf, out_f, dout.f, lse_f, rdq, rdk, rdv, opt);
      require_ulps(dq, rdq, 0.5);
      require_ulps(dk, rdk, 0.5);
      require_ulps(dv, rdv, 0.5);
    };
    check(S{});
    check(float{});
  }
  // Backward holds one head's dk and dv in f32: 2 S D floats beyond the f32 tiles.
  const std::size_t tiles = cpu::attention_scratch_bytes_per_thread(64, dtype::f32);
  REQUIRE(cpu::attention_scratch_bytes_per_thread(64, dtype_of<S>, 1000) ==
          tiles + 2 * 1000 * 64 * sizeof(float));
}
