// Tests of the attention layer: forward against a naive double-loop attention (fused and separate
// projections, multi-head and grouped-query, with and without RoPE), backward against central
// finite differences, gradient accumulation and errors that name the layer.
#include <catch2/catch.hpp>

#include <cmath>
#include <sstream>

#include "models/layers/attention.hpp"
#include "models/layers/testing.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;

namespace {

std::string describe_config(const attention::config& c) {
  std::ostringstream os;
  os << "dim " << c.dim << " heads " << c.n_head << "/" << c.n_kv_head << " head_dim " << c.head_dim
     << (c.fused_qkv ? " fused" : " separate") << " qkv_bias " << c.qkv_bias << " out_bias "
     << c.out_bias << " rope " << c.rope << " theta " << c.rope_theta << " causal " << c.causal;
  return os.str();
}

// The configurations under test: GPT-2-like, Llama-like (GQA + RoPE), and mixtures.
std::vector<attention::config> configs() {
  return {
      {.dim = 8,
       .n_head = 2,
       .n_kv_head = 2,
       .head_dim = 4,
       .fused_qkv = true,
       .qkv_bias = true,
       .out_bias = true,
       .rope = false},
      {.dim = 8,
       .n_head = 4,
       .n_kv_head = 2,
       .head_dim = 4,
       .fused_qkv = false,
       .qkv_bias = false,
       .out_bias = false,
       .rope = true,
       .rope_theta = 10000.0},
      {.dim = 6,
       .n_head = 4,
       .n_kv_head = 1,
       .head_dim = 4,
       .fused_qkv = true,
       .qkv_bias = true,
       .out_bias = false,
       .rope = true,
       .rope_theta = 500000.0},
      {.dim = 6,
       .n_head = 3,
       .n_kv_head = 3,
       .head_dim = 2,
       .fused_qkv = false,
       .qkv_bias = true,
       .out_bias = true,
       .rope = true,
       .rope_theta = 100.0,
       .causal = false},
  };
}

// Naive attention of x [B, T, C] with the layer's bound weights, in double loops.
std::vector<double> attention_ref(const attention& a, const std::vector<double>& x, std::int64_t nb,
                                  std::int64_t nt) {
  const auto& c = a.cfg;
  const std::int64_t hq = c.n_head, hkv = c.n_kv_head, d = c.head_dim, n = nb * nt;
  // q[n][h][i], k/v[n][h][i] as flat vectors.
  std::vector<double> q(n * hq * d), k(n * hkv * d), v(n * hkv * d);
  if (c.fused_qkv) {
    auto qkv = linear_ref(x, n, a.qkv_proj);
    std::int64_t w = (hq + 2 * hkv) * d;
    for (std::int64_t r = 0; r < n; ++r) {
      for (std::int64_t j = 0; j < hq * d; ++j) q[r * hq * d + j] = qkv[r * w + j];
      for (std::int64_t j = 0; j < hkv * d; ++j) {
        k[r * hkv * d + j] = qkv[r * w + hq * d + j];
        v[r * hkv * d + j] = qkv[r * w + (hq + hkv) * d + j];
      }
    }
  } else {
    q = linear_ref(x, n, a.q_proj);
    k = linear_ref(x, n, a.k_proj);
    v = linear_ref(x, n, a.v_proj);
  }
  if (c.rope) {  // rotate-half: pairs (i, i + d/2), angle = t * theta^(-2i/d)
    auto rotate = [&](std::vector<double>& z, std::int64_t heads) {
      for (std::int64_t r = 0; r < n; ++r) {
        std::int64_t t = r % nt;
        for (std::int64_t h = 0; h < heads; ++h)
          for (std::int64_t i = 0; i < d / 2; ++i) {
            double ang = static_cast<double>(t) * std::pow(c.rope_theta, -2.0 * i / d);
            double* p = &z[(r * heads + h) * d];
            double x1 = p[i], x2 = p[i + d / 2];
            p[i] = x1 * std::cos(ang) - x2 * std::sin(ang);
            p[i + d / 2] = x2 * std::cos(ang) + x1 * std::sin(ang);
          }
      }
    };
    rotate(q, hq);
    rotate(k, hkv);
  }
  std::vector<double> att(n * hq * d, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (std::int64_t b = 0; b < nb; ++b)
    for (std::int64_t h = 0; h < hq; ++h) {
      std::int64_t kh = h / (hq / hkv);
      for (std::int64_t t = 0; t < nt; ++t) {
        std::int64_t last = c.causal ? t : nt - 1;
        std::vector<double> p(last + 1);
        double m = -1e300;
        for (std::int64_t s = 0; s <= last; ++s) {
          double dotp = 0;
          for (std::int64_t i = 0; i < d; ++i)
            dotp += q[((b * nt + t) * hq + h) * d + i] * k[((b * nt + s) * hkv + kh) * d + i];
          p[s] = dotp * scale;
          m = std::max(m, p[s]);
        }
        double z = 0;
        for (auto& e : p) z += (e = std::exp(e - m));
        for (std::int64_t s = 0; s <= last; ++s)
          for (std::int64_t i = 0; i < d; ++i)
            att[((b * nt + t) * hq + h) * d + i] += p[s] / z * v[((b * nt + s) * hkv + kh) * d + i];
      }
    }
  return linear_ref(att, n, a.o_proj);
}

}  // namespace

TEST_CASE("Attention forward matches a naive reference with RoPE and grouped-query heads",
          "[cpu]") {
  rng g(101);
  for (const auto& cfg : configs()) {
    INFO(describe_config(cfg));
    attention attn(cfg);
    slot_list s;
    attn.declare(s, "attn", {2, 5});
    layer_memory mem(s, dtype::f64);
    randomize_params(s, g);
    auto x = random_tensor({2, 5, cfg.dim}, g);
    auto y = host_zeros({2, 5, cfg.dim});
    attn.forward(x, y);
    // f64 against double loops: rounding only (max_rel_diff in testing.hpp), measured <= 8e-14.
    CHECK(max_rel_diff(values(y), attention_ref(attn, values(x), 2, 5)) <= 1e-11);

    // A shorter batch than planned uses a prefix of the planned buffers and RoPE tables.
    auto xs = random_tensor({1, 3, cfg.dim}, g);
    auto ys = host_zeros({1, 3, cfg.dim});
    attn.forward(xs, ys);
    CHECK(max_rel_diff(values(ys), attention_ref(attn, values(xs), 1, 3)) <= 1e-11);
  }
}

TEST_CASE("Attention backward matches finite differences", "[cpu]") {
  rng g(102);
  for (const auto& cfg : configs()) {
    INFO(describe_config(cfg));
    attention attn(cfg);
    slot_list s;
    attn.declare(s, "attn", {2, 4});
    layer_memory mem(s, dtype::f64);
    randomize_params(s, g);
    auto x = random_tensor({2, 4, cfg.dim}, g);
    auto y = host_zeros({2, 4, cfg.dim});
    auto r = random_tensor({2, 4, cfg.dim}, g);
    auto dx = host_zeros({2, 4, cfg.dim});
    auto loss = [&] {
      attn.forward(x, y);
      return dot(y, r);
    };
    loss();
    attn.backward(r, dx);
    check_gradient("dx", x, values(dx), loss, g, {.max_elems = 64});
    check_param_gradients(s, loss, g);
    check_accumulation(
        mem, [&] { attn.backward(r, dx); }, dx);
  }
}

TEST_CASE("Attention gives errors that name the layer", "[cpu]") {
  rng g(103);
  attention attn({.dim = 8, .n_head = 2, .rope = true});
  CHECK(attn.cfg.n_kv_head == 2);
  CHECK(attn.cfg.head_dim == 4);
  slot_list s;
  attn.declare(s, "h.0.attn", {2, 4});
  layer_memory mem(s, dtype::f64);
  auto x2 = random_tensor({8, 8}, g);
  auto y2 = host_zeros({8, 8});
  REQUIRE_THROWS_WITH(attn.forward(x2, y2), Catch::Contains("attention 'h.0.attn'") &&
                                                Catch::Contains("x must be [B, T, 8]"));
  auto xl = random_tensor({1, 6, 8}, g);  // 6 rows fit the 8 planned, but 6 > 4 positions
  auto yl = host_zeros({1, 6, 8});
  REQUIRE_THROWS_WITH(attn.forward(xl, yl),
                      Catch::Contains("attention 'h.0.attn'") && Catch::Contains("RoPE tables"));
  REQUIRE_THROWS_WITH(attn.backward(yl, xl), Catch::Contains("before forward"));

  attention gqa({.dim = 8, .n_head = 3, .n_kv_head = 2, .head_dim = 2});
  slot_list s2;
  REQUIRE_THROWS_WITH(gqa.declare(s2, "bad", {1, 2}), Catch::Contains("attention 'bad'") &&
                                                          Catch::Contains("multiple of n_kv_head"));
}
