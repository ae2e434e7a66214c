// The Llama composition (embedding, RMSNorm, GQA attention with RoPE, SwiGLU, tied or untied head,
// loss) against finite differences in f64, its parameter names against HF's, and its errors.
#include <catch2/catch.hpp>

#include <cmath>
#include <set>
#include <string>

#include "models/layers/testing.hpp"
#include "models/llama.hpp"
#include "models/optim.hpp"
#include "models/targets.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;

TEST_CASE("The tiny Llama's gradients match finite differences of its loss", "[cpu]") {
  for (bool tied : {false, true}) {
    for (bool bias : {false, true}) {
      INFO("tie_embeddings " << tied << " attention_bias " << bias);
      llama_config cfg{.vocab = 11,
                       .dim = 8,
                       .n_layer = 2,
                       .n_head = 4,
                       .n_kv_head = 2,
                       .hidden = 12,
                       .rms_eps = 1e-5,
                       .rope_theta = 500.0,
                       .max_seq = 8,
                       .tie_embeddings = tied,
                       .attention_bias = bias};
      llama model(cfg, {2, 5}, dtype::f64);
      model.init_weights(7);
      rng g(5);
      randomize_params(model.slots(), g, 0.5);  // larger than HF init so every path matters
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
  }
}

TEST_CASE("The Llama parameters carry Hugging Face names without the model prefix", "[cpu]") {
  for (bool tied : {false, true}) {
    llama_config cfg{
        .vocab = 16, .dim = 8, .n_layer = 2, .n_head = 2, .hidden = 12, .tie_embeddings = tied};
    llama model(cfg, {1, 4});
    std::set<std::string> names;
    for (const auto& s : model.slots().slots())
      if (s.kind == slot_kind::param) names.insert(s.name);
    std::set<std::string> want = {"embed_tokens.weight", "norm.weight"};
    if (!tied) want.insert("lm_head.weight");
    for (int i = 0; i < 2; ++i) {
      std::string p = "layers." + std::to_string(i) + ".";
      for (const char* n :
           {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
            "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"})
        want.insert(p + n);
    }
    CHECK(names == want);
  }
}

TEST_CASE("Llama init follows HF: unit norms and N(0 std) projections", "[cpu]") {
  llama_config cfg{.vocab = 64,
                   .dim = 32,
                   .n_layer = 1,
                   .n_head = 4,
                   .hidden = 48,
                   .attention_bias = true,
                   .init_std = 0.05};
  llama model(cfg, {1, 4}, dtype::f64);
  model.init_weights(3);
  for (const auto& s : model.slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    INFO(s.name);
    std::vector<double> v = values(*s.field);
    double sum = 0, sq = 0;
    for (double x : v) {
      sum += x;
      sq += x * x;
    }
    double n = static_cast<double>(v.size());
    if (s.name.find("norm") != std::string::npos) {
      CHECK(sum == n);
    } else if (s.name.ends_with(".bias")) {
      CHECK(sq == 0.0);
    } else {
      // The sample std of n >= 768 normal draws is within 10% of 0.05 with overwhelming odds.
      CHECK(std::sqrt(sq / n) == Approx(0.05).epsilon(0.1));
      CHECK(std::abs(sum / n) < 0.01);
    }
  }
}

TEST_CASE("Training the tiny Llama on one batch drives its loss down", "[cpu]") {
  llama_config cfg{.vocab = 32,
                   .dim = 32,
                   .n_layer = 2,
                   .n_head = 4,
                   .n_kv_head = 2,
                   .hidden = 64,
                   .max_seq = 16};
  llama model(cfg, {4, 16});
  model.init_weights(1);
  adamw_optimizer opt(model.memory().params(), {.weight_decay = 0.0});
  std::vector<std::int32_t> in(64), tg(64);
  rng g(3);
  for (auto& v : in) v = static_cast<std::int32_t>(g.integer(0, 31));
  tensor ids(in.data(), 256, dtype::i32, {4, 16}), targets(tg.data(), 256, dtype::i32, {4, 16});
  next_token_targets(ids, targets);
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

TEST_CASE("next_token_targets shifts ids left and ignores the last position", "[cpu]") {
  std::vector<std::int32_t> in = {1, 2, 3, 4, 5, 6}, out(6, 0);
  tensor ids(in.data(), 24, dtype::i32, {2, 3}), targets(out.data(), 24, dtype::i32, {2, 3});
  next_token_targets(ids, targets);
  CHECK(out == std::vector<std::int32_t>{2, 3, -100, 5, 6, -100});
  REQUIRE_THROWS_WITH(next_token_targets(ids, ids), Catch::Contains("alias"));
  REQUIRE_THROWS_WITH(next_token_targets(ids, targets.narrow(1, 0, 2)),
                      Catch::Contains("like ids"));
}

TEST_CASE("llama rejects bad configs and batches larger than planned", "[cpu]") {
  llama_config cfg{.vocab = 8, .dim = 8, .n_layer = 1, .n_head = 2, .hidden = 8, .max_seq = 4};
  REQUIRE_THROWS_WITH(llama({.vocab = 8, .dim = 8, .n_layer = 1, .n_head = 2}, {1, 4}),
                      Catch::Contains("intermediate_size"));
  REQUIRE_THROWS_WITH(llama({.vocab = 8, .dim = 9, .n_layer = 1, .n_head = 2, .hidden = 8}, {1, 4}),
                      Catch::Contains("multiple of n_head"));
  REQUIRE_THROWS_WITH(
      llama({.vocab = 8, .dim = 8, .n_layer = 1, .n_head = 4, .n_kv_head = 3, .hidden = 8}, {1, 4}),
      Catch::Contains("multiple of n_kv_head"));
  REQUIRE_THROWS_WITH(
      llama({.vocab = 8, .dim = 12, .n_layer = 1, .n_head = 4, .hidden = 8}, {1, 4}),
      Catch::Contains("even head_dim"));
  REQUIRE_THROWS_WITH(llama(cfg, {1, 8}), Catch::Contains("exceeds max_seq"));
  llama model(cfg, {1, 4});
  std::vector<std::int32_t> in(10, 1);
  tensor ids(in.data(), 40, dtype::i32, {2, 5});
  REQUIRE_THROWS_WITH(model.forward(ids, ids), Catch::Contains("exceeds the planned"));
  REQUIRE_THROWS_WITH(model.backward(), Catch::Contains("before forward"));
}
