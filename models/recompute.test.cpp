// Activation checkpointing (recompute per block) and loss scaling, for GPT-2 and Llama: recomputed
// blocks give the same gradients bit for bit as stored ones (the same ops run in the same order),
// over training steps and around kv-cache generation; the plan holds one block's activations
// instead of all of them; backward(loss_scale) scales the gradients exactly; finite differences
// still hold with recompute on.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/gpt.hpp"
#include "models/layers/testing.hpp"
#include "models/llama.hpp"
#include "models/optim.hpp"
#include "models/targets.hpp"
#include "tensor/ops.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;

namespace {

gpt_config tiny_gpt(bool recompute) {
  return {.vocab = 37, .max_seq = 16, .dim = 32, .n_layer = 3, .n_head = 4, .recompute = recompute};
}

llama_config tiny_llama(bool recompute) {
  return {.vocab = 37,
          .dim = 32,
          .n_layer = 3,
          .n_head = 4,
          .n_kv_head = 2,
          .hidden = 48,
          .rope_theta = 500.0,
          .max_seq = 16,
          .attention_bias = true,
          .recompute = recompute};
}

// A batch of random ids [b, t] and their next-token targets, owned.
struct batch {
  std::vector<std::int32_t> in, tg;
  tensor ids, targets;
  batch(std::int64_t b, std::int64_t t, std::int64_t vocab, rng& g) : in(b * t), tg(b * t) {
    for (auto& v : in) v = static_cast<std::int32_t>(g.integer(0, vocab - 1));
    ids = tensor(in.data(), in.size() * 4, dtype::i32, {b, t});
    targets = tensor(tg.data(), tg.size() * 4, dtype::i32, {b, t});
    next_token_targets(ids, targets);
  }
};

bool same_bytes(const tensor& a, const tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// Trains a stored and a recomputed copy of one model side by side for a few AdamW steps (one of
// them on a shorter batch than planned, one after kv-cache generation): losses, gradients and
// parameters must be equal bit for bit at every step.
template <class Model, class Config>
void check_recompute_is_exact(Config (*make)(bool)) {
  Model plain(make(false), {3, 12}), recomputed(make(true), {3, 12});
  plain.init_weights(11);
  recomputed.init_weights(11);
  REQUIRE(same_bytes(plain.memory().params(), recomputed.memory().params()));
  adamw_optimizer opt_a(plain.memory().params(), {.weight_decay = 0.1});
  adamw_optimizer opt_b(recomputed.memory().params(), {.weight_decay = 0.1});
  rng g(23);
  const std::int64_t vocab = make(false).vocab;
  for (int step = 0; step < 4; ++step) {
    INFO("step " << step);
    batch data(step == 1 ? 2 : 3, step == 1 ? 7 : 12, vocab, g);
    plain.memory().zero_grads();
    recomputed.memory().zero_grads();
    double la = plain.forward(data.ids, data.targets);
    double lb = recomputed.forward(data.ids, data.targets);
    CHECK(la == lb);
    plain.backward();
    recomputed.backward();
    double norm = 0;
    for (float v :
         std::vector<float>(ptr<float>(plain.memory().grads()),
                            ptr<float>(plain.memory().grads()) + plain.memory().grads().numel()))
      norm += static_cast<double>(v) * v;
    REQUIRE(norm > 0);
    CHECK(same_bytes(plain.memory().grads(), recomputed.memory().grads()));
    opt_a.step(plain.memory().params(), plain.memory().grads(), 1e-2);
    opt_b.step(recomputed.memory().params(), recomputed.memory().grads(), 1e-2);
    REQUIRE(same_bytes(plain.memory().params(), recomputed.memory().params()));
    if (step == 2) {  // generation reuses the (shared) block activations; training goes on after
      plain.begin_generation(2);
      recomputed.begin_generation(2);
      for (std::int64_t t : {5, 1, 1}) {
        batch ids(2, t, vocab, g);
        CHECK(same_bytes(plain.step_logits(ids.ids), recomputed.step_logits(ids.ids)));
      }
    }
  }
}

}  // namespace

TEST_CASE("Recomputed GPT blocks give the same gradients bit for bit over training steps",
          "[cpu]") {
  check_recompute_is_exact<gpt>(&tiny_gpt);
}

TEST_CASE("Recomputed Llama layers give the same gradients bit for bit over training steps",
          "[cpu]") {
  check_recompute_is_exact<llama>(&tiny_llama);
}

TEST_CASE("Activations of recomputed scopes share bytes with their siblings only", "[cpu]") {
  tensor x, a_h, a_in, b_h, b_in, b_s;
  slot_list s;
  s.activation("x", {64}, x);
  {
    auto a = s.enter_recomputed("a");
    s.activation("h", {64}, a_h);
    auto inner = s.enter("inner");  // nested: still live only while "a" is open
    s.activation("y", {32}, a_in);
  }
  {
    auto b = s.enter_recomputed("b");
    s.activation("h", {64}, b_h);
    auto inner = s.enter("inner");
    s.activation("y", {32}, b_in);
    s.scratch("s", {16}, b_s);
  }
  layer_memory mem(s, dtype::f32);
  // x (256 bytes) for the whole step, plus one scope's 256 + 128 bytes (64-byte aligned sizes).
  CHECK(mem.activation_bytes() == 256 + 256 + 128);
  auto overlap = [](const tensor& p, const tensor& q) {
    auto* a = static_cast<const char*>(p.data());
    auto* b = static_cast<const char*>(q.data());
    return a < b + q.nbytes() && b < a + p.nbytes();
  };
  for (const tensor* t : {&a_h, &a_in, &b_h, &b_in}) CHECK_FALSE(overlap(x, *t));
  CHECK_FALSE(overlap(a_h, a_in));
  CHECK_FALSE(overlap(b_h, b_in));
  CHECK((overlap(a_h, b_h) || overlap(a_h, b_in)));
  CHECK(mem.scratch_bytes() == 64);
  const auto& slots = s.slots();
  CHECK(slots[0].last > slots[4].last);  // x outlives every scope
  CHECK(slots[1].first == slots[2].first);
  CHECK(slots[1].last == slots[2].last);  // the nested activation lives as long as "a"
}

namespace {

// Bytes of the activation slots whose name starts with `prefix` (or of those outside every block
// when prefix is empty), each rounded up to the planner's 64-byte alignment.
std::size_t activation_bytes_of(const slot_list& s, const std::string& prefix,
                                const std::string& block_prefix) {
  std::size_t n = 0;
  for (const auto& slot : s.slots()) {
    if (slot.kind != slot_kind::activation) continue;
    bool in_block = slot.name.rfind(block_prefix, 0) == 0;
    if (prefix.empty() ? in_block : slot.name.rfind(prefix, 0) != 0) continue;
    n += (static_cast<std::size_t>(slot.sizes.numel()) * 4 + 63) / 64 * 64;
  }
  return n;
}

// Without recompute the plan holds the activations of every block; with it, those of one block.
template <class Model, class Config>
void check_activation_bytes(Config cfg, const std::string& block_prefix) {
  batch_dims dims{4, 16};
  cfg.recompute = false;
  Model plain(cfg, dims);
  cfg.recompute = true;
  Model recomputed(cfg, dims);
  const std::size_t top = activation_bytes_of(plain.slots(), "", block_prefix);
  const std::size_t block = activation_bytes_of(plain.slots(), block_prefix + "0.", block_prefix);
  const auto n = static_cast<std::size_t>(cfg.n_layer);
  for (std::size_t i = 1; i < n; ++i)
    REQUIRE(activation_bytes_of(plain.slots(), block_prefix + std::to_string(i) + ".",
                                block_prefix) == block);
  REQUIRE(block > 0);
  CHECK(plain.memory().activation_bytes() == top + n * block);
  CHECK(recomputed.memory().activation_bytes() == top + block);
  // The residual stream (n + 1 block inputs) is most of what is left.
  CHECK(activation_bytes_of(recomputed.slots(), "", block_prefix) == top);
  CHECK(plain.memory().scratch_bytes() == recomputed.memory().scratch_bytes());
  CHECK(plain.memory().param_bytes() == recomputed.memory().param_bytes());
}

}  // namespace

TEST_CASE("Recompute plans one block of activations instead of one per block", "[cpu]") {
  SECTION("gpt") {
    gpt_config cfg{.vocab = 64, .max_seq = 16, .dim = 32, .n_layer = 6, .n_head = 4};
    check_activation_bytes<gpt>(cfg, "h.");
  }
  SECTION("llama") {
    llama_config cfg{.vocab = 64,
                     .dim = 32,
                     .n_layer = 6,
                     .n_head = 4,
                     .n_kv_head = 2,
                     .hidden = 80,
                     .max_seq = 16};
    check_activation_bytes<llama>(cfg, "layers.");
  }
  SECTION("make_causal_lm passes the option on") {
    auto mcfg = named_model_config("llama-tiny").value();
    auto plain = make_causal_lm(mcfg, {2, 32});
    auto recomputed = make_causal_lm(mcfg, {2, 32}, dtype::f32, device::cpu(), {.recompute = true});
    CHECK(recomputed->memory().activation_bytes() < plain->memory().activation_bytes() / 2);
  }
}

namespace {

// backward(loss_scale) gives loss_scale times the gradients of backward(): exactly for a power of
// two (every rounding commutes with it, f32), and to rounding for 3 in f64. That rounding is the
// f64 backward's own: the same operations as the f32 backward's, each rounding 2^-29 times
// smaller, so it is bounded by the f32 run's measured error (f32 vs f64 gradients) scaled by
// 2^-29, times default_k and 2 (scaled and unscaled both round), with tests/rounding.hpp's floor.
template <class Model, class Config>
void check_loss_scale(Config cfg) {
  std::vector<double> once32;  // the f32 gradients, to measure the f32 rounding
  for (dtype t : {dtype::f32, dtype::f64}) {
    INFO(dtype_name(t));
    const double scale = t == dtype::f32 ? 1024.0 : 3.0;
    Model model(cfg, {2, 9}, t);
    model.init_weights(5);
    rng g(8);
    batch data(2, 9, cfg.vocab, g);
    auto& mem = model.memory();
    auto grads = [&] {
      auto host = empty(mem.grads().sizes(), dtype::f64);
      ops::copy(mem.grads(), host);
      return values(host);
    };
    mem.zero_grads();
    model.forward(data.ids, data.targets);
    model.backward();
    std::vector<double> once = grads();
    mem.zero_grads();
    model.forward(data.ids, data.targets);
    model.backward(scale);
    std::vector<double> scaled = grads();
    double top = 0, worst = 0;
    for (std::size_t i = 0; i < once.size(); ++i) {
      top = std::max(top, std::abs(once[i]));
      worst = std::max(worst, std::abs(scaled[i] - scale * once[i]));
    }
    REQUIRE(top > 0);
    if (t == dtype::f32) {
      CHECK(worst == 0.0);
      once32 = once;
    } else {
      const auto f32_err = tests::as_accurate_as(once32, once32, once);
      const double bound = 2 * tests::default_k * scale / static_cast<double>(1 << 29) *
                           std::max(f32_err.err_ref, tests::default_floor * tests::f32_u * top);
      INFO("max |scaled - 3 once| " << worst << ", bound " << bound
                                    << "; f32 gradients: " << f32_err.str());
      CHECK(worst <= bound);
    }
  }
}

}  // namespace

TEST_CASE("backward with a loss scale gives the gradients of the scaled loss", "[cpu]") {
  SECTION("gpt") {
    check_loss_scale<gpt>(tiny_gpt(true));
  }
  SECTION("llama") {
    check_loss_scale<llama>(tiny_llama(false));
  }
  SECTION("through causal_lm") {
    auto m = make_causal_lm(named_model_config("gpt2-demo").value(), {1, 8});
    m->init_weights(2);
    rng g(4);
    batch data(1, 8, m->vocab(), g);
    m->memory().zero_grads();
    m->forward(data.ids, data.targets);
    m->backward();
    std::vector<float> once(ptr<float>(m->memory().grads()),
                            ptr<float>(m->memory().grads()) + m->memory().grads().numel());
    m->memory().zero_grads();
    m->forward(data.ids, data.targets);
    m->backward(0.25);
    const float* scaled = ptr<float>(m->memory().grads());
    std::size_t off = 0;
    for (std::size_t i = 0; i < once.size(); ++i) off += scaled[i] != 0.25f * once[i];
    CHECK(off == 0);
  }
}

TEST_CASE("Recomputed models still match finite differences of their loss", "[cpu]") {
  auto run = [](auto& model, std::int64_t vocab) {
    model.init_weights(7);
    rng g(5);
    randomize_params(model.slots(), g, 0.4);
    batch data(2, 5, vocab, g);
    data.tg[1] = -100;
    auto loss = [&] { return model.forward(data.ids, data.targets); };
    model.memory().zero_grads();
    loss();
    model.backward();
    check_param_gradients(model.slots(), loss, g, {.max_elems = 16});
  };
  SECTION("gpt") {
    gpt model({.vocab = 11, .max_seq = 6, .dim = 8, .n_layer = 3, .n_head = 2, .recompute = true},
              {2, 5}, dtype::f64);
    run(model, 11);
  }
  SECTION("llama") {
    llama model({.vocab = 11,
                 .dim = 8,
                 .n_layer = 3,
                 .n_head = 4,
                 .n_kv_head = 2,
                 .hidden = 12,
                 .rms_eps = 1e-5,
                 .rope_theta = 500.0,
                 .max_seq = 8,
                 .attention_bias = true,
                 .recompute = true},
                {2, 5}, dtype::f64);
    run(model, 11);
  }
}
