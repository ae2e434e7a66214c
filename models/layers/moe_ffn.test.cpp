// Tests of the MoE layer (moe_ffn.hpp, moe_routing.hpp): forward against plain f64 loops, backward
// (through the routing weights, the renormalisation, the shared expert's gate and the aux loss's
// d p) against central finite differences, the capacity's dropped choices, and the expert index
// each expert's parameters declare.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "models/layers/moe_ffn.hpp"
#include "models/layers/testing.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;

namespace {

double silu(double v) {
  return v / (1.0 + std::exp(-v));
}

// y of x [n, C] by plain loops: softmax of the router, top-k (renormalised or not), SwiGLU experts,
// the shared expert times sigmoid of its gate.
std::vector<double> moe_ref(const moe_ffn& ff, const std::vector<double>& x, std::int64_t n) {
  const std::int64_t c = ff.cfg.dim, ne = ff.cfg.n_expert;
  const std::vector<double> logits = linear_ref(x, n, ff.gate);
  auto expert = [&](const swiglu_mlp& e, const std::vector<double>& row) {
    auto g = linear_ref(row, 1, e.gate_proj), u = linear_ref(row, 1, e.up_proj);
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = silu(g[i]) * u[i];
    return linear_ref(g, 1, e.down_proj);
  };
  std::vector<double> y(static_cast<std::size_t>(n * c), 0.0);
  for (std::int64_t r = 0; r < n; ++r) {
    std::vector<double> p(logits.begin() + r * ne, logits.begin() + (r + 1) * ne);
    const double mx = *std::max_element(p.begin(), p.end());
    double z = 0;
    for (double& v : p) z += (v = std::exp(v - mx));
    for (double& v : p) v /= z;
    std::vector<int> order(static_cast<std::size_t>(ne));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
    double sum = 0;
    for (int k = 0; k < ff.cfg.top_k; ++k) sum += p[order[k]];
    const std::vector<double> row(x.begin() + r * c, x.begin() + (r + 1) * c);
    for (int k = 0; k < ff.cfg.top_k; ++k) {
      const double w = ff.cfg.norm_topk_prob ? p[order[k]] / sum : p[order[k]];
      const auto out = expert(ff.experts[order[k]], row);
      for (std::int64_t i = 0; i < c; ++i) y[r * c + i] += w * out[i];
    }
    if (ff.cfg.shared_hidden > 0) {
      const double s = 1.0 / (1.0 + std::exp(-linear_ref(row, 1, ff.shared_expert_gate)[0]));
      const auto out = expert(ff.shared_expert, row);
      for (std::int64_t i = 0; i < c; ++i) y[r * c + i] += s * out[i];
    }
  }
  return y;
}

struct variant {
  bool norm;
  std::int64_t shared;
};

}  // namespace

TEST_CASE("MoE layer forward is the weighted sum of each token's chosen experts", "[cpu]") {
  rng g(71);
  for (variant v : {variant{true, 0}, variant{false, 3}}) {  // Mixtral's, Qwen2-MoE's
    INFO("norm_topk_prob " << v.norm << ", shared_hidden " << v.shared);
    moe_ffn ff({.dim = 6,
                .hidden = 5,
                .n_expert = 4,
                .top_k = 2,
                .norm_topk_prob = v.norm,
                .shared_hidden = v.shared});
    slot_list s;
    ff.declare(s, "mlp", {2, 5});
    layer_memory mem(s, dtype::f64);
    randomize_params(s, g, 0.8);
    auto x = random_tensor({2, 5, 6}, g, 2.0);
    auto y = host_zeros({2, 5, 6});
    ff.forward(x, y);
    CHECK(max_rel_diff(values(y), moe_ref(ff, values(x), 10)) <= 1e-12);  // f64 rounding
    // Load statistics: every token chooses top_k experts, none dropped without a capacity.
    CHECK(std::accumulate(ff.routing.selected.begin(), ff.routing.selected.end(),
                          std::int64_t{0}) == 10 * 2);
    CHECK(ff.routing.dropped == 0);
    double probs = 0;
    for (double p : ff.prob_sum) probs += p;
    CHECK(std::abs(probs - 10.0) <= 1e-12);
  }
}

TEST_CASE("MoE layer backward matches finite differences through the routing weights", "[cpu]") {
  rng g(72);
  for (variant v : {variant{true, 0}, variant{false, 3}}) {
    INFO("norm_topk_prob " << v.norm << ", shared_hidden " << v.shared);
    moe_ffn ff({.dim = 5,
                .hidden = 4,
                .n_expert = 4,
                .top_k = 2,
                .norm_topk_prob = v.norm,
                .shared_hidden = v.shared});
    slot_list s;
    ff.declare(s, "mlp", {3, 4});
    layer_memory mem(s, dtype::f64);
    randomize_params(s, g, 0.8);
    auto x = random_tensor({3, 4, 5}, g, 2.0);
    auto y = host_zeros({3, 4, 5});
    auto r = random_tensor({3, 4, 5}, g);
    auto dx = host_zeros({3, 4, 5});
    // The aux loss's gradient in p enters as a constant per expert: the loss gets its linear
    // term sum_e aux_dprob[e] * sum_n p[n, e].
    ff.aux_dprob = {0.3, -0.2, 0.5, 0.1};
    auto loss = [&] {
      ff.forward(x, y);
      double l = dot(y, r);
      for (std::size_t e = 0; e < ff.aux_dprob.size(); ++e) l += ff.aux_dprob[e] * ff.prob_sum[e];
      return l;
    };
    loss();
    // Every expert serves some token, so every expert's gradient is checked.
    for (auto n : ff.routing.selected) REQUIRE(n > 0);
    ff.backward(r, dx);
    check_gradient("dx", x, values(dx), loss, g);
    check_param_gradients(s, loss, g);
    check_accumulation(
        mem, [&] { ff.backward(r, dx); }, dx);
  }
}

TEST_CASE("A capacity serves first choices first and counts the dropped ones", "[cpu]") {
  rng g(73);
  // 16 tokens x top-2 over 4 experts at capacity factor 0.5: 4 rows per expert.
  moe_ffn ff({.dim = 4, .hidden = 3, .n_expert = 4, .top_k = 2, .capacity_factor = 0.5});
  slot_list s;
  ff.declare(s, "mlp", {1, 16});
  layer_memory mem(s, dtype::f64);
  randomize_params(s, g, 1.0);
  // A router that sends most tokens to expert 0 first.
  ptr(ff.gate.weight)[0] = 3.0;
  auto x = random_tensor({1, 16, 4}, g, 1.0);
  for (std::int64_t n = 0; n < 16; ++n) ptr(x)[n * 4] = 2.0 + 0.1 * static_cast<double>(n % 3);
  auto y = host_zeros({1, 16, 4});
  ff.forward(x, y);
  REQUIRE(ff.capacity(16) == 4);
  std::int64_t over = 0;
  for (std::size_t e = 0; e < 4; ++e) {
    const auto& list = ff.routing.experts[e];
    CHECK(static_cast<std::int64_t>(list.size()) <= 4);
    over += std::max<std::int64_t>(0, ff.routing.selected[e] - 4);
    // Served in choice order: no second choice before a first one.
    for (std::size_t j = 1; j < list.size(); ++j) CHECK(list[j - 1].choice <= list[j].choice);
  }
  CHECK(ff.routing.dropped == over);
  CHECK(ff.routing.dropped > 0);  // the router above overloads expert 0
  // A dropped choice adds nothing: y is the served choices' weighted outputs only.
  std::vector<double> want(16 * 4, 0.0);
  for (std::size_t e = 0; e < 4; ++e) {
    const auto& list = ff.routing.experts[e];
    for (std::size_t j = 0; j < list.size(); ++j)
      for (std::int64_t i = 0; i < 4; ++i)
        want[list[j].row * 4 + i] +=
            list[j].weight * ptr(ff.expert_out[e])[static_cast<std::int64_t>(j) * 4 + i];
  }
  CHECK(max_rel_diff(values(y), want) <= 1e-12);
}

TEST_CASE("Each expert's parameters declare its index and the router none", "[cpu]") {
  moe_ffn ff({.dim = 4, .hidden = 3, .n_expert = 3, .top_k = 1, .shared_hidden = 2});
  slot_list s;
  ff.declare(s, "mlp", {1, 2});
  int experts = 0;
  for (const auto& slot : s.slots()) {
    if (slot.kind != slot_kind::param) continue;
    INFO(slot.name);
    const auto at = slot.name.find("experts.");
    if (at == std::string::npos || slot.name.find("shared_expert") != std::string::npos) {
      CHECK(slot.spec.expert == -1);
      continue;
    }
    ++experts;
    CHECK(slot.spec.expert == std::stoi(slot.name.substr(at + 8)));
  }
  CHECK(experts == 3 * 3);
}
