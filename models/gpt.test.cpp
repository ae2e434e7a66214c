// The GPT composition (embeddings, blocks, tied head, loss) against finite differences, the
// optimizer against torch's formulas, and the data sampler's determinism.
#include <catch2/catch.hpp>

#include <cmath>

#include "models/byte_data.hpp"
#include "models/gpt.hpp"
#include "models/layers/testing.hpp"
#include "models/optim.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;

TEST_CASE("The tiny GPT's gradients match finite differences of its loss", "[cpu]") {
  gpt_config cfg{.vocab = 11, .max_seq = 6, .dim = 8, .n_layer = 2, .n_head = 2};
  gpt model(cfg, {2, 5}, dtype::f64);
  model.init_weights(7);
  rng g(5);
  randomize_params(model.slots(), g, 0.3);  // larger than GPT-2 init so every path matters
  std::vector<std::int32_t> in(10), tg(10);
  for (auto& v : in) v = static_cast<std::int32_t>(g.integer(0, 10));
  for (auto& v : tg) v = static_cast<std::int32_t>(g.integer(0, 10));
  tg[3] = -100;  // an ignored position
  tensor ids(in.data(), 40, dtype::i32, {2, 5}), targets(tg.data(), 40, dtype::i32, {2, 5});
  auto loss = [&] { return model.forward(ids, targets); };
  model.memory().zero_grads();
  loss();
  model.backward();
  check_param_gradients(model.slots(), loss, g, {.max_elems = 24});
}

TEST_CASE("Training the tiny GPT on one batch drives its loss down", "[cpu]") {
  gpt_config cfg{.vocab = 32, .max_seq = 16, .dim = 32, .n_layer = 2, .n_head = 4};
  gpt model(cfg, {4, 16});
  model.init_weights(1);
  adamw_optimizer opt(model.memory().params(), {.weight_decay = 0.0});
  std::vector<std::int32_t> in(64), tg(64);
  rng g(3);
  for (int i = 0; i < 64; ++i) {
    in[i] = static_cast<std::int32_t>(g.integer(0, 31));
    tg[i] = (in[i] * 7 + 3) % 32;  // a learnable map
  }
  tensor ids(in.data(), 256, dtype::i32, {4, 16}), targets(tg.data(), 256, dtype::i32, {4, 16});
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    model.memory().zero_grads();
    last = model.forward(ids, targets);
    if (step == 0) first = last;
    model.backward();
    clip_grad_norm(model.memory().grads(), 1.0);
    opt.step(model.memory().params(), model.memory().grads(), 1e-2);
  }
  // Not rounding: training behaviour, with margins of whole nats.
  CHECK(first == Approx(std::log(32.0)).epsilon(0.05));  // near-uniform at init
  CHECK(last < 0.2 * first);
}

TEST_CASE("gpt rejects batches larger than planned and bad configs") {
  gpt_config cfg{.vocab = 8, .max_seq = 4, .dim = 8, .n_layer = 1, .n_head = 2};
  gpt model(cfg, {1, 4});
  std::vector<std::int32_t> in(10, 1);
  tensor ids(in.data(), 40, dtype::i32, {2, 5});
  REQUIRE_THROWS_WITH(model.forward(ids, ids), Catch::Contains("exceeds the planned"));
  REQUIRE_THROWS_WITH(gpt({.vocab = 8, .max_seq = 4, .dim = 9, .n_layer = 1, .n_head = 2}, {1, 4}),
                      Catch::Contains("multiple of n_head"));
  REQUIRE_THROWS_WITH(gpt(cfg, {1, 8}), Catch::Contains("exceeds max_seq"));
}

TEST_CASE("clip_grad_norm returns the norm before clipping and scales like torch") {
  std::vector<float> g = {3, 4};
  tensor t(g.data(), 8, dtype::f32, {2});
  // Approx's default: 100 f32 epsilons (1.2e-5) relative, for a few f32 roundings (6e-8 each).
  CHECK(clip_grad_norm(t, 10.0) == Approx(5.0));
  CHECK(g[0] == 3.0f);
  CHECK(clip_grad_norm(t, 1.0) == Approx(5.0));
  CHECK(g[0] == Approx(3.0 / (5.0 + 1e-6)));
  CHECK(g[1] == Approx(4.0 / (5.0 + 1e-6)));
}

TEST_CASE("adamw_optimizer follows torch.optim.AdamW step by step") {
  std::vector<float> p = {1.0f, -2.0f}, gr = {0.5f, 0.25f};
  tensor tp(p.data(), 8, dtype::f32, {2}), tg(gr.data(), 8, dtype::f32, {2});
  adamw_optimizer opt(tp, {.beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1});
  double ref[2] = {1.0, -2.0}, m[2] = {0, 0}, v[2] = {0, 0};
  for (int step = 1; step <= 3; ++step) {
    opt.step(tp, tg, 0.01);
    for (int i = 0; i < 2; ++i) {
      double g = gr[i];
      ref[i] -= 0.01 * 0.1 * ref[i];
      m[i] = 0.9 * m[i] + 0.1 * g;
      v[i] = 0.99 * v[i] + 0.01 * g * g;
      double mh = m[i] / (1 - std::pow(0.9, step)), vh = v[i] / (1 - std::pow(0.99, step));
      ref[i] -= 0.01 * mh / (std::sqrt(vh) + 1e-8);
      // f32 against f64 formulas: each step rounds p, m, v and the update a few times (u = 6e-8
      // relative each), ~4e-7 after 3 steps at worst; a wrong formula is off by ~lr = 1e-2.
      CHECK(p[i] == Approx(ref[i]).epsilon(1e-6));
    }
  }
  CHECK(opt.steps_taken() == 3);
}

TEST_CASE("warmup then cosine decay reaches min_lr at the end") {
  CHECK(warmup_cosine_lr(0, 10, 100, 1.0, 0.1) == Approx(0.1));
  CHECK(warmup_cosine_lr(9, 10, 100, 1.0, 0.1) == Approx(1.0));
  CHECK(warmup_cosine_lr(10, 10, 100, 1.0, 0.1) == Approx(1.0));
  CHECK(warmup_cosine_lr(55, 10, 100, 1.0, 0.1) == Approx(0.55));
  CHECK(warmup_cosine_lr(100, 10, 100, 1.0, 0.1) == Approx(0.1));
}

TEST_CASE("batches are a pure function of seed and step") {
  std::vector<std::uint8_t> corpus(1000);
  for (std::size_t i = 0; i < corpus.size(); ++i) corpus[i] = static_cast<std::uint8_t>(i * 31);
  std::vector<std::int32_t> a, b, c;
  sample_batch(corpus, 42, 7, 3, 16, a);
  sample_batch(corpus, 42, 7, 3, 16, b);
  sample_batch(corpus, 42, 8, 3, 16, c);
  CHECK(a == b);
  CHECK(a != c);
  REQUIRE(a.size() == 3 * 17);
  // Each row is a run of consecutive corpus bytes.
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 16; ++i)
      CHECK(static_cast<std::uint8_t>(a[r * 17 + i + 1]) ==
            static_cast<std::uint8_t>(a[r * 17 + i] + 31));
  REQUIRE_THROWS_WITH(read_text_corpus("/no/such/corpus"), Catch::Contains("/no/such/corpus"));
}

TEST_CASE("adamw exempts biases norms and embeddings from weight decay on request") {
  gpt_config cfg{.vocab = 8, .max_seq = 4, .dim = 8, .n_layer = 1, .n_head = 2};
  gpt model(cfg, {1, 4});
  model.init_weights(3);
  auto& mem = model.memory();
  mem.zero_grads();  // zero gradients: only weight decay moves parameters
  auto before = to_device(mem.params(), device::cpu());
  adamw_optimizer opt(mem.params(), {.weight_decay = 0.5});
  opt.exempt_from_decay(model.slots(), mem.params(), biases_norms_embeddings);
  opt.step(mem.params(), mem.grads(), 0.1);
  const float* b = before.data_as<float>();
  const float* a = mem.params().data_as<float>();
  for (const auto& s : model.slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    INFO(s.name);
    auto off = s.field->data_as<float>() - mem.params().data_as<float>();
    bool exempt =
        s.sizes.rank() < 2 || s.name.rfind("wte.", 0) == 0 || s.name.rfind("wpe.", 0) == 0;
    // One f32 multiply per weight (Approx's default 1.2e-5 relative covers its rounding, 6e-8).
    for (std::int64_t i = 0; i < s.field->numel(); ++i)
      REQUIRE(a[off + i] == Approx(exempt ? b[off + i] : b[off + i] * (1 - 0.1 * 0.5)));
  }
}
