// Tests of the row-wise layers (linear, embedding, layernorm, rmsnorm, mlp, swiglu_mlp) and the
// cross-entropy loss: forward against plain f64 loops, backward against central finite
// differences, parameter-gradient accumulation, slot planning and errors that name the layer.
#include <catch2/catch.hpp>

#include <cmath>

#include "models/layers/cross_entropy.hpp"
#include "models/layers/embedding.hpp"
#include "models/layers/layernorm.hpp"
#include "models/layers/linear.hpp"
#include "models/layers/mlp.hpp"
#include "models/layers/rmsnorm.hpp"
#include "models/layers/swiglu_mlp.hpp"
#include "models/layers/testing.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;

namespace {

double gelu_tanh(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}
double silu(double x) {
  return x / (1.0 + std::exp(-x));
}

}  // namespace

// ---- linear ------------------------------------------------------------------------------------

TEST_CASE("Linear forward matches a plain matrix product", "[cpu]") {
  rng g(11);
  for (bool bias : {true, false}) {
    linear fc({.in = 5, .out = 7, .bias = bias});
    slot_list s;
    fc.declare(s, "fc");
    layer_memory mem(s, dtype::f64);
    randomize_params(s, g);
    auto x = random_tensor({2, 3, 5}, g);
    auto y = host_zeros({2, 3, 7});
    fc.forward(x, y);
    // f64 against a plain loop: rounding only (max_rel_diff in testing.hpp).
    CHECK(max_rel_diff(values(y), linear_ref(values(x), 6, fc)) <= 1e-12);
  }
}

TEST_CASE("Linear backward matches finite differences", "[cpu]") {
  rng g(12);
  for (bool bias : {true, false}) {
    INFO("bias " << bias);
    linear fc({.in = 6, .out = 4, .bias = bias});
    slot_list s;
    fc.declare(s, "fc");
    layer_memory mem(s, dtype::f64);
    randomize_params(s, g);
    auto x = random_tensor({2, 3, 6}, g);
    auto y = host_zeros({2, 3, 4});
    auto r = random_tensor({2, 3, 4}, g);
    auto dx = host_zeros({2, 3, 6});
    auto loss = [&] {
      fc.forward(x, y);
      return dot(y, r);
    };
    loss();
    fc.backward(r, dx);
    check_gradient("dx", x, values(dx), loss, g);
    check_param_gradients(s, loss, g);
    check_accumulation(
        mem, [&] { fc.backward(r, dx); }, dx);
  }
}

TEST_CASE("Linear backward can add into dx", "[cpu]") {
  rng g(13);
  linear fc({.in = 3, .out = 5});
  slot_list s;
  fc.declare(s, "fc");
  layer_memory mem(s, dtype::f64);
  randomize_params(s, g);
  auto x = random_tensor({4, 3}, g);
  auto y = host_zeros({4, 5});
  auto dy = random_tensor({4, 5}, g);
  auto dx = host_zeros({4, 3});
  fc.forward(x, y);
  fc.backward(dy, dx);
  auto once = values(dx);
  fc.backward(dy, dx, /*accumulate_dx=*/true);
  for (auto& v : once) v *= 2;
  // dx + dx = 2 dx exactly when the GEMM adds its product into dx once (measured: equal); one
  // more f64 rounding per block of the inner dimension otherwise, far under 1e-12.
  CHECK(max_rel_diff(values(dx), once) <= 1e-12);
}

// ---- embedding ---------------------------------------------------------------------------------

TEST_CASE("Embedding gathers rows and scatters gradients with repeated ids", "[cpu]") {
  rng g(21);
  embedding wte({.vocab = 7, .dim = 4});
  slot_list s;
  wte.declare(s, "wte");
  layer_memory mem(s, dtype::f64);
  randomize_params(s, g);
  auto ids = empty({2, 3}, dtype::i64);
  std::int64_t id_values[] = {3, 0, 3, 6, 3, 1};  // 3 repeats: its gradient sums three rows
  std::memcpy(ids.data(), id_values, sizeof id_values);
  auto y = host_zeros({2, 3, 4});
  auto r = random_tensor({2, 3, 4}, g);
  wte.forward(ids, y);
  for (int n = 0; n < 6; ++n)
    for (int c = 0; c < 4; ++c) CHECK(ptr(y)[n * 4 + c] == ptr(wte.weight)[id_values[n] * 4 + c]);
  auto loss = [&] {
    wte.forward(ids, y);
    return dot(y, r);
  };
  wte.backward(r);
  check_param_gradients(s, loss, g);
  check_accumulation(mem, [&] { wte.backward(r); });
}

// ---- norms -------------------------------------------------------------------------------------

TEST_CASE("LayerNorm forward matches a plain reference", "[cpu]") {
  rng g(31);
  for (bool bias : {true, false}) {
    layernorm ln({.dim = 8, .eps = 1e-5, .bias = bias});
    slot_list s;
    ln.declare(s, "ln", {2, 3});
    layer_memory mem(s, dtype::f64);
    randomize_params(s, g);
    auto x = random_tensor({2, 3, 8}, g, 2.0);
    auto y = host_zeros({2, 3, 8});
    ln.forward(x, y);
    std::vector<double> want(48);
    for (int n = 0; n < 6; ++n) {
      const double* xr = ptr(x) + n * 8;
      double mean = 0, var = 0;
      for (int c = 0; c < 8; ++c) mean += xr[c] / 8;
      for (int c = 0; c < 8; ++c) var += (xr[c] - mean) * (xr[c] - mean) / 8;
      for (int c = 0; c < 8; ++c)
        want[n * 8 + c] = (xr[c] - mean) / std::sqrt(var + 1e-5) * ptr(ln.weight)[c] +
                          (bias ? ptr(ln.bias)[c] : 0.0);
    }
    CHECK(max_rel_diff(values(y), want) <=
          1e-12);  // f64 rounding only (testing.hpp)  // f64 rounding only (testing.hpp)
  }
}

TEST_CASE("LayerNorm backward matches finite differences", "[cpu]") {
  rng g(32);
  for (bool bias : {true, false}) {
    INFO("bias " << bias);
    layernorm ln({.dim = 6, .eps = 1e-5, .bias = bias});
    slot_list s;
    ln.declare(s, "ln", {2, 4});
    layer_memory mem(s, dtype::f64);
    randomize_params(s, g);
    auto x = random_tensor({2, 4, 6}, g, 2.0);
    auto y = host_zeros({2, 4, 6});
    auto r = random_tensor({2, 4, 6}, g);
    auto dx = host_zeros({2, 4, 6});
    auto loss = [&] {
      ln.forward(x, y);
      return dot(y, r);
    };
    loss();
    ln.backward(r, dx);
    check_gradient("dx", x, values(dx), loss, g);
    check_param_gradients(s, loss, g);
    check_accumulation(
        mem, [&] { ln.backward(r, dx); }, dx);
  }
}

TEST_CASE("RMSNorm forward matches a plain reference", "[cpu]") {
  rng g(33);
  rmsnorm norm({.dim = 8, .eps = 1e-6});
  slot_list s;
  norm.declare(s, "norm", {3, 2});
  layer_memory mem(s, dtype::f64);
  randomize_params(s, g);
  auto x = random_tensor({3, 2, 8}, g, 2.0);
  auto y = host_zeros({3, 2, 8});
  norm.forward(x, y);
  std::vector<double> want(48);
  for (int n = 0; n < 6; ++n) {
    const double* xr = ptr(x) + n * 8;
    double ms = 0;
    for (int c = 0; c < 8; ++c) ms += xr[c] * xr[c] / 8;
    for (int c = 0; c < 8; ++c)
      want[n * 8 + c] = xr[c] / std::sqrt(ms + 1e-6) * ptr(norm.weight)[c];
  }
  CHECK(max_rel_diff(values(y), want) <= 1e-12);  // f64 rounding only (testing.hpp)
}

TEST_CASE("RMSNorm backward matches finite differences", "[cpu]") {
  rng g(34);
  rmsnorm norm({.dim = 6, .eps = 1e-6});
  slot_list s;
  norm.declare(s, "norm", {2, 3});
  layer_memory mem(s, dtype::f64);
  randomize_params(s, g);
  auto x = random_tensor({2, 3, 6}, g, 2.0);
  auto y = host_zeros({2, 3, 6});
  auto r = random_tensor({2, 3, 6}, g);
  auto dx = host_zeros({2, 3, 6});
  auto loss = [&] {
    norm.forward(x, y);
    return dot(y, r);
  };
  loss();
  norm.backward(r, dx);
  check_gradient("dx", x, values(dx), loss, g);
  check_param_gradients(s, loss, g);
  check_accumulation(
      mem, [&] { norm.backward(r, dx); }, dx);
}

// ---- feed-forward blocks -----------------------------------------------------------------------

TEST_CASE("MLP forward matches fc then GELU tanh then proj", "[cpu]") {
  rng g(41);
  mlp ff({.dim = 4, .hidden = 10, .bias = true});
  slot_list s;
  ff.declare(s, "mlp", {2, 3});
  layer_memory mem(s, dtype::f64);
  randomize_params(s, g);
  auto x = random_tensor({2, 3, 4}, g);
  auto y = host_zeros({2, 3, 4});
  ff.forward(x, y);
  auto h = linear_ref(values(x), 6, ff.fc);
  for (auto& v : h) v = gelu_tanh(v);
  CHECK(max_rel_diff(values(y), linear_ref(h, 6, ff.proj)) <= 1e-12);  // f64 rounding only
}

TEST_CASE("MLP backward matches finite differences", "[cpu]") {
  rng g(42);
  for (bool bias : {true, false}) {
    INFO("bias " << bias);
    mlp ff({.dim = 4, .hidden = 12, .bias = bias});
    slot_list s;
    ff.declare(s, "mlp", {2, 3});
    layer_memory mem(s, dtype::f64);
    randomize_params(s, g);
    auto x = random_tensor({2, 3, 4}, g, 2.0);
    auto y = host_zeros({2, 3, 4});
    auto r = random_tensor({2, 3, 4}, g);
    auto dx = host_zeros({2, 3, 4});
    auto loss = [&] {
      ff.forward(x, y);
      return dot(y, r);
    };
    loss();
    ff.backward(r, dx);
    check_gradient("dx", x, values(dx), loss, g);
    check_param_gradients(s, loss, g);
    check_accumulation(
        mem, [&] { ff.backward(r, dx); }, dx);
  }
}

TEST_CASE("SwiGLU MLP forward matches down of silu gate times up", "[cpu]") {
  rng g(43);
  for (bool bias : {false, true}) {  // HF's mlp_bias: all three projections
    INFO("bias " << bias);
    swiglu_mlp ff({.dim = 4, .hidden = 6, .bias = bias, .out_bias = bias});
    slot_list s;
    ff.declare(s, "mlp", {1, 5});
    layer_memory mem(s, dtype::f64);
    randomize_params(s, g);
    bool down_bias = false;
    for (const auto& slot : s.slots()) down_bias |= slot.name == "mlp.down_proj.bias";
    CHECK(down_bias == bias);
    auto x = random_tensor({1, 5, 4}, g);
    auto y = host_zeros({1, 5, 4});
    ff.forward(x, y);
    auto gate = linear_ref(values(x), 5, ff.gate_proj);
    auto up = linear_ref(values(x), 5, ff.up_proj);
    for (std::size_t i = 0; i < gate.size(); ++i) gate[i] = silu(gate[i]) * up[i];
    CHECK(max_rel_diff(values(y), linear_ref(gate, 5, ff.down_proj)) <= 1e-12);  // f64 rounding
  }
}

TEST_CASE("SwiGLU MLP backward matches finite differences", "[cpu]") {
  rng g(44);
  for (bool bias : {false, true}) {
    INFO("bias " << bias);
    swiglu_mlp ff({.dim = 5, .hidden = 8, .bias = bias, .out_bias = bias});
    slot_list s;
    ff.declare(s, "mlp", {2, 2});
    layer_memory mem(s, dtype::f64);
    randomize_params(s, g);
    auto x = random_tensor({2, 2, 5}, g, 2.0);
    auto y = host_zeros({2, 2, 5});
    auto r = random_tensor({2, 2, 5}, g);
    auto dx = host_zeros({2, 2, 5});
    auto loss = [&] {
      ff.forward(x, y);
      return dot(y, r);
    };
    loss();
    ff.backward(r, dx);
    check_gradient("dx", x, values(dx), loss, g);
    check_param_gradients(s, loss, g);
    check_accumulation(
        mem, [&] { ff.backward(r, dx); }, dx);
  }
}

// ---- cross-entropy -----------------------------------------------------------------------------

TEST_CASE("Cross-entropy loss is the mean over non-ignored positions", "[cpu]") {
  rng g(51);
  const std::int64_t n = 6, vocab = 5;
  cross_entropy_loss ce;
  slot_list s;
  ce.declare(s, "loss", {2, 3});
  layer_memory mem(s, dtype::f64);
  auto logits = random_tensor({2, 3, vocab}, g, 3.0);
  auto targets = empty({2, 3}, dtype::i32);
  std::int32_t t[] = {1, -100, 4, 0, -100, 2};
  std::memcpy(targets.data(), t, sizeof t);
  double loss = ce.forward(logits, targets);
  double want = 0;
  int count = 0;
  for (int r = 0; r < n; ++r) {
    if (t[r] == -100) continue;
    const double* row = ptr(logits) + r * vocab;
    double m = *std::max_element(row, row + vocab), z = 0;
    for (int v = 0; v < vocab; ++v) z += std::exp(row[v] - m);
    want += m + std::log(z) - row[t[r]];
    ++count;
  }
  want /= count;
  CHECK(ce.count == 4);
  // f64: 4 log-sum-exps of 5 terms and their mean round to ~10 u = 1e-15 relative.
  CHECK(std::abs(loss - want) <= 1e-12 * std::abs(want));

  SECTION("its gradient matches finite differences") {
    auto dlogits = host_zeros({2, 3, vocab});
    ce.backward(dlogits, 2.5);  // d(2.5 * loss)
    auto f = [&] { return 2.5 * ce.forward(logits, targets); };
    check_gradient("dlogits", logits, values(dlogits), f, g, {.max_elems = 100});
    for (int v = 0; v < vocab; ++v) CHECK(ptr(dlogits)[1 * vocab + v] == 0.0);  // ignored row
  }
  SECTION("dlogits may alias the logits") {
    auto dlogits = host_zeros({2, 3, vocab});
    ce.backward(dlogits);
    auto want_grad = values(dlogits);
    ce.backward(logits);
    CHECK(max_rel_diff(values(logits), want_grad) <= 1e-12);  // the same f64 ops, in place
  }
  SECTION("all positions ignored gives zero loss and zero gradient") {
    std::int32_t none[] = {-100, -100, -100, -100, -100, -100};
    std::memcpy(targets.data(), none, sizeof none);
    CHECK(ce.forward(logits, targets) == 0.0);
    auto dlogits = random_tensor({2, 3, vocab}, g);
    ce.backward(dlogits);
    for (double v : values(dlogits)) CHECK(v == 0.0);
  }
}

// ---- slots and planning ------------------------------------------------------------------------

TEST_CASE("Slots get dotted names and sibling scratch shares memory", "[cpu]") {
  mlp a({.dim = 4, .hidden = 16}), b({.dim = 4, .hidden = 16});
  slot_list s;
  {
    auto h = s.enter("h");
    a.declare(s, "0", {2, 8});
    b.declare(s, "1", {2, 8});
  }
  std::vector<std::string> names;
  for (const auto& slot : s.slots()) names.push_back(slot.name);
  CHECK(std::find(names.begin(), names.end(), "h.0.fc.weight") != names.end());
  CHECK(std::find(names.begin(), names.end(), "h.1.proj.bias") != names.end());
  CHECK(std::find(names.begin(), names.end(), "h.1.da") != names.end());
  CHECK(a.label == "mlp 'h.0'");
  CHECK(a.fc.label == "linear 'h.0.fc'");
  CHECK(s.param_count() == 2 * (4 * 16 + 16 + 16 * 4 + 4));

  layer_memory mem(s, dtype::f32);
  // Two mlps' scratch (da, dh: 2 x [16, 16] f32 each) never run at once: one set of bytes.
  CHECK(mem.scratch_bytes_without_reuse() == 2 * 2 * 16 * 16 * 4);
  CHECK(mem.scratch_bytes() == 2 * 16 * 16 * 4);
  CHECK(a.da.data() == b.da.data());
  CHECK(a.da.data() != a.dh.data());
  // Activations do not share, parameters sit inside the flat views, grads start at zero.
  CHECK(a.h.data() != b.h.data());
  auto inside = [](const tensor& t, const tensor& flat) {
    auto* p = static_cast<const char*>(t.data());
    auto* lo = static_cast<const char*>(flat.data());
    return p >= lo && p + t.nbytes() <= lo + flat.nbytes();
  };
  CHECK(inside(a.fc.weight, mem.params()));
  CHECK(inside(b.proj.dbias, mem.grads()));
  CHECK(mem.params().numel() >= s.param_count());
  for (float v :
       std::vector<float>(ptr<float>(mem.grads()), ptr<float>(mem.grads()) + mem.grads().numel()))
    REQUIRE(v == 0.0f);
}

TEST_CASE("Layers run on a smaller batch than the one planned", "[cpu]") {
  rng g(61);
  layernorm ln({.dim = 4});
  slot_list s;
  ln.declare(s, "ln", {4, 8});
  layer_memory mem(s, dtype::f64);
  randomize_params(s, g);
  auto x = random_tensor({2, 3, 4}, g);
  auto y = host_zeros({2, 3, 4});
  auto dx = host_zeros({2, 3, 4});
  ln.forward(x, y);
  ln.backward(y, dx);  // shapes agree: no error
  auto big = random_tensor({5, 8, 4}, g);
  auto big_y = host_zeros({5, 8, 4});
  REQUIRE_THROWS_WITH(ln.forward(big, big_y),
                      Catch::Contains("layernorm 'ln'") && Catch::Contains("planned for"));
}

// ---- errors name the layer ---------------------------------------------------------------------

TEST_CASE("Wrong shapes give errors that name the layer", "[cpu]") {
  rng g(71);
  slot_list s;
  linear fc({.in = 4, .out = 3});
  layernorm ln({.dim = 4});
  rmsnorm norm({.dim = 4});
  embedding wte({.vocab = 10, .dim = 4});
  mlp ff({.dim = 4, .hidden = 8});
  cross_entropy_loss ce;
  fc.declare(s, "fc");
  ln.declare(s, "ln_f", {1, 4});
  norm.declare(s, "norm", {1, 4});
  wte.declare(s, "wte");
  ff.declare(s, "mlp", {1, 4});
  ce.declare(s, "loss", {1, 4});
  layer_memory mem(s, dtype::f64);

  auto x5 = random_tensor({1, 4, 5}, g);
  auto y3 = host_zeros({1, 4, 3});
  auto y5 = host_zeros({1, 4, 5});
  REQUIRE_THROWS_WITH(fc.forward(x5, y3),
                      Catch::Contains("linear 'fc'") && Catch::Contains("x must be [..., 4]"));
  auto x4 = random_tensor({1, 4, 4}, g);
  auto y4 = host_zeros({1, 4, 4});
  REQUIRE_THROWS_WITH(fc.forward(x4, y4),
                      Catch::Contains("linear 'fc'") && Catch::Contains("y must be [1, 4, 3]"));
  REQUIRE_THROWS_WITH(fc.backward(y3, x4),
                      Catch::Contains("linear 'fc'") && Catch::Contains("before forward"));
  REQUIRE_THROWS_WITH(ln.forward(x5, y5), Catch::Contains("layernorm 'ln_f'"));
  REQUIRE_THROWS_WITH(norm.forward(x5, y5), Catch::Contains("rmsnorm 'norm'"));
  REQUIRE_THROWS_WITH(ff.forward(x5, y5), Catch::Contains("mlp 'mlp'"));
  auto bad_ids = random_tensor({1, 4}, g);
  REQUIRE_THROWS_WITH(wte.forward(bad_ids, y4),
                      Catch::Contains("embedding 'wte'") && Catch::Contains("i32 or i64"));
  auto targets = empty({1, 3}, dtype::i64);
  REQUIRE_THROWS_WITH(ce.forward(x4, targets), Catch::Contains("cross_entropy_loss 'loss'"));
  linear unbound({.in = 4, .out = 3});
  REQUIRE_THROWS_WITH(unbound.forward(x4, y3), Catch::Contains("not bound"));
}
