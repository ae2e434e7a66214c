// Incremental decoding with a kv cache: for GPT-2 and Llama, the logits of the prompt step and of
// every later one-token step equal the full forward's logits at that position (f64), and the
// cache's bounds give clear errors.
#include <catch2/catch.hpp>

#include <vector>

#include "memory/gpu.hpp"
#include "models/gpt.hpp"
#include "models/layers/testing.hpp"
#include "models/llama.hpp"
#include "tensor/ops.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;

namespace {

// Runs the full forward on ids [B, T], then the cached path: the first `prompt` positions as one
// step, then chunks of `chunk` positions; every step's last-position logits must equal the full
// forward's at that position. In f64 both paths do the same sums in (nearly) the same order, and
// reassociating sums of <= 24 terms of O(1) moves a value by <= K u sum|terms| ~ 1e-14 of the
// largest logit (u = 2^-53) on any kernel: 1e-10 leaves room for that only, while a wrong position
// or cache slot is off by O(1) of it.
template <class Model>
void check_cached_logits(Model& model, std::int64_t b, std::int64_t t, std::int64_t vocab,
                         std::int64_t prompt, std::int64_t chunk, rng& g) {
  std::vector<std::int32_t> in(b * t), tg(b * t, -100);
  for (auto& v : in) v = static_cast<std::int32_t>(g.integer(0, vocab - 1));
  tensor ids(in.data(), in.size() * 4, dtype::i32, {b, t});
  tensor targets(tg.data(), tg.size() * 4, dtype::i32, {b, t});
  model.forward(ids, targets);
  std::vector<double> full = values(model.logits());  // [B*T, V]
  double scale = 0;
  for (double v : full) scale = std::max(scale, std::abs(v));
  REQUIRE(scale > 0);

  model.begin_generation(b);
  std::int64_t pos = 0;
  int steps = 0;
  while (pos < t) {
    std::int64_t n = pos == 0 ? prompt : std::min(chunk, t - pos);
    // The new ids as their own contiguous [B, n] tensor, as a sampler would pass them.
    std::vector<std::int32_t> step_ids(b * n);
    for (std::int64_t r = 0; r < b; ++r)
      for (std::int64_t i = 0; i < n; ++i) step_ids[r * n + i] = in[r * t + pos + i];
    tensor sid(step_ids.data(), step_ids.size() * 4, dtype::i32, {b, n});
    tensor out = model.step_logits(sid);
    REQUIRE(out.sizes() == shape({b, vocab}));
    pos += n;
    ++steps;
    CHECK(model.generated_length() == pos);
    std::vector<double> got = values(out);
    double worst = 0;
    for (std::int64_t r = 0; r < b; ++r)
      for (std::int64_t v = 0; v < vocab; ++v)
        worst = std::max(worst, std::abs(got[r * vocab + v] - full[(r * t + pos - 1) * vocab + v]));
    INFO("position " << pos - 1 << " (step " << steps << ")");
    CHECK(worst <= 1e-10 * scale);
  }
  CHECK(steps == 1 + (t - prompt + chunk - 1) / chunk);
}

}  // namespace

TEST_CASE("GPT-2 cached decoding gives the full forward's logits at every position", "[cpu]") {
  gpt_config cfg{.vocab = 13, .max_seq = 12, .dim = 16, .n_layer = 2, .n_head = 4};
  gpt model(cfg, {2, 10}, dtype::f64);
  model.init_weights(1);
  rng g(11);
  randomize_params(model.slots(), g, 0.5);
  check_cached_logits(model, 2, 10, cfg.vocab, 4, 1, g);
  // Again on the same cache, with a one-token prompt and two-token chunks.
  check_cached_logits(model, 2, 10, cfg.vocab, 1, 2, g);
}

TEST_CASE("Llama cached decoding gives the full forward's logits at every position", "[cpu]") {
  for (bool tied : {false, true}) {
    INFO("tie_embeddings " << tied);
    llama_config cfg{.vocab = 13,
                     .dim = 16,
                     .n_layer = 2,
                     .n_head = 4,
                     .n_kv_head = 2,
                     .hidden = 24,
                     .rope_theta = 100.0,  // fast rotations: a wrong position offset shows
                     .max_seq = 12,
                     .tie_embeddings = tied,
                     .attention_bias = tied};
    llama model(cfg, {2, 10}, dtype::f64);
    model.init_weights(2);
    rng g(12);
    randomize_params(model.slots(), g, 0.5);
    check_cached_logits(model, 2, 10, cfg.vocab, 4, 1, g);
    check_cached_logits(model, 2, 10, cfg.vocab, 3, 3, g);
  }
}

// Llama 3.x: llama3 and linear RoPE scaling and biases on the MLP. Their frequencies do not depend
// on the length, so the cache gives the full forward's logits as without scaling. (Dynamic scaling
// does not: each step uses the length so far, as HF does; hf_reference.test.cpp proves that
// against HF's own cached decoding.)
TEST_CASE("Llama with llama3 or linear rope_scaling decodes from the cache as the full forward",
          "[cpu]") {
  const rope_scaling llama3{.type = rope_scaling::kind::llama3,
                            .factor = 8.0,
                            .low_freq_factor = 1.0,
                            .high_freq_factor = 4.0,
                            .original_max_position = 32};
  const rope_scaling linear{.type = rope_scaling::kind::linear, .factor = 4.0};
  for (const rope_scaling& scaling : {llama3, linear}) {
    INFO("rope_scaling " << rope_type_name(scaling.type));
    llama_config cfg{.vocab = 13,
                     .dim = 32,
                     .n_layer = 2,
                     .n_head = 4,
                     .n_kv_head = 2,
                     .hidden = 24,
                     .rope_theta = 100.0,  // head_dim 8: the three llama3 bands
                     .max_seq = 12,
                     .attention_bias = true,
                     .mlp_bias = true,
                     .rope_scale = scaling};
    llama model(cfg, {2, 10}, dtype::f64);
    model.init_weights(2);
    rng g(13);
    randomize_params(model.slots(), g, 0.5);
    check_cached_logits(model, 2, 10, cfg.vocab, 4, 1, g);
    check_cached_logits(model, 2, 10, cfg.vocab, 3, 3, g);
  }
}

TEST_CASE("Cached decoding in f32 agrees with f64", "[cpu]") {
  llama_config cfg{.vocab = 13,
                   .dim = 16,
                   .n_layer = 2,
                   .n_head = 4,
                   .n_kv_head = 2,
                   .hidden = 24,
                   .max_seq = 12};
  // The cached f32 step (under test) against the f64 step (exact), judged by the rounding of the
  // f32 full forward over the same prefix (the reference: another path to the same logits) as in
  // tests/rounding.hpp.
  llama m32(cfg, {1, 8}), m64(cfg, {1, 8}, dtype::f64), full32(cfg, {1, 8});
  m32.init_weights(4);
  m64.init_weights(4);  // the same f64 draws, rounded to f32 in m32
  full32.init_weights(4);
  std::vector<std::int32_t> in = {3, 1, 4, 1, 5, 9, 2, 6}, tg(8, -100);
  m32.begin_generation(1);
  m64.begin_generation(1);
  for (std::size_t i = 0; i < in.size(); ++i) {
    INFO("position " << i);
    tensor id(&in[i], 4, dtype::i32, {1, 1});
    tensor a = m32.step_logits(id), b = m64.step_logits(id);
    const auto t = static_cast<std::int64_t>(i + 1);
    full32.forward(tensor(in.data(), t * 4, dtype::i32, {1, t}),
                   tensor(tg.data(), t * 4, dtype::i32, {1, t}));
    const float* last = ptr<float>(full32.logits()) + (t - 1) * cfg.vocab;
    const auto v =
        tests::as_accurate_as(std::vector<float>(ptr<float>(a), ptr<float>(a) + cfg.vocab),
                              std::vector<float>(last, last + cfg.vocab), values(b));
    INFO(v.str());
    CHECK(v.ok());
  }
}

TEST_CASE("Cached decoding rejects steps past the cache and before begin_generation", "[cpu]") {
  llama_config cfg{.vocab = 8, .dim = 8, .n_layer = 1, .n_head = 2, .hidden = 8, .max_seq = 6};
  llama model(cfg, {2, 4});
  model.init_weights(1);
  std::vector<std::int32_t> in(8, 1);
  tensor ids(in.data(), 32, dtype::i32, {2, 4});
  REQUIRE_THROWS_WITH(model.step_logits(ids), Catch::Contains("before begin_generation"));
  REQUIRE_THROWS_WITH(model.begin_generation(3), Catch::Contains("planned batch"));
  REQUIRE_THROWS_WITH(model.begin_generation(1, 7), Catch::Contains("max_seq"));
  model.begin_generation(2);
  model.step_logits(ids);
  REQUIRE_THROWS_WITH(model.step_logits(ids), Catch::Contains("exceed the cache capacity 6"));
  tensor two(in.data(), 16, dtype::i32, {2, 2});
  model.step_logits(two);  // fills it exactly
  CHECK(model.generated_length() == 6);

  gpt g({.vocab = 8, .max_seq = 6, .dim = 8, .n_layer = 1, .n_head = 2}, {2, 4});
  g.begin_generation(2, 5);
  g.step_logits(ids);
  REQUIRE_THROWS_WITH(g.step_logits(ids), Catch::Contains("exceed the cache capacity 5"));
}

TEST_CASE("Cached decoding on a GPU gives the full forward's logits", "[gpu]") {
  if (!memory::gpu_available()) {
    WARN("troupe-skip: no GPU");
    return;
  }
  const device gpu = device::cuda();
  auto host = [](const tensor& t) {
    auto h = to_device(t, device::cpu());
    std::vector<double> v(h.numel());
    for (std::int64_t i = 0; i < h.numel(); ++i) v[i] = ptr<float>(h)[i];
    return v;
  };
  const std::int64_t b = 2, t = 9, vocab = 13;
  rng g(21);
  std::vector<std::int32_t> in(b * t), tg(b * t, -100);
  for (auto& v : in) v = static_cast<std::int32_t>(g.integer(0, vocab - 1));
  auto ids = to_device(tensor(in.data(), in.size() * 4, dtype::i32, {b, t}), gpu);
  auto targets = to_device(tensor(tg.data(), tg.size() * 4, dtype::i32, {b, t}), gpu);
  auto run = [&](auto& model) {
    for (const auto& slot : model.slots().slots()) {  // larger than init: attention not uniform
      if (slot.kind != slot_kind::param) continue;
      auto v = empty(slot.sizes, dtype::f32);
      for (std::int64_t i = 0; i < v.numel(); ++i)
        ptr<float>(v)[i] = static_cast<float>(g.uniform(-0.5, 0.5));
      ops::copy(to_device(v, gpu), *slot.field);
    }
    model.forward(ids, targets);
    std::vector<double> full = host(model.logits());
    double scale = 0;
    for (double v : full) scale = std::max(scale, std::abs(v));
    model.begin_generation(b);
    for (std::int64_t pos = 0; pos < t;) {
      std::int64_t n = pos == 0 ? 3 : 1;  // a 3-token prompt, then one token per step
      std::vector<std::int32_t> step_ids(b * n);
      for (std::int64_t r = 0; r < b; ++r)
        for (std::int64_t i = 0; i < n; ++i) step_ids[r * n + i] = in[r * t + pos + i];
      auto sid = to_device(tensor(step_ids.data(), step_ids.size() * 4, dtype::i32, {b, n}), gpu);
      std::vector<double> got = host(model.step_logits(sid));
      pos += n;
      double worst = 0;
      for (std::int64_t r = 0; r < b; ++r)
        for (std::int64_t v = 0; v < vocab; ++v)
          worst =
              std::max(worst, std::abs(got[r * vocab + v] - full[(r * t + pos - 1) * vocab + v]));
      INFO("position " << pos - 1);
      // f32 with different attention tilings: rounding only, ~1e-7 of the scale for these sums of
      // <= 24 terms (a few u = 6e-8 each); 1e-5 is 100 times that, far below a wrong position.
      CHECK(worst <= 1e-5 * scale);
    }
  };
  gpt gm({.vocab = vocab, .max_seq = 12, .dim = 16, .n_layer = 2, .n_head = 4}, {b, t}, dtype::f32,
         gpu);
  run(gm);
  llama lm({.vocab = vocab,
            .dim = 16,
            .n_layer = 2,
            .n_head = 4,
            .n_kv_head = 2,
            .hidden = 24,
            .rope_theta = 100.0,
            .max_seq = 12},
           {b, t}, dtype::f32, gpu);
  run(lm);
}
