#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "models/generation.hpp"
#include "models/trainer.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;

TEST_CASE("Greedy generation with the kv cache equals re-running the whole sequence", "[cpu]") {
  for (const char* size : {"gpt2-demo", "llama-tiny"}) {
    INFO(size);
    auto cfg = named_model_config(size, 40).value();
    auto cached = make_causal_lm(cfg, {1, 32});
    auto full = make_causal_lm(cfg, {1, 32});
    auto exact = make_causal_lm(cfg, {1, 32}, dtype::f64);  // f32's weights, in f64
    cached->init_weights(4);
    full->init_weights(4);
    exact->init_weights(4);
    std::vector<std::int32_t> prompt = {3, 14, 15, 9, 2};
    token_sampler greedy({.greedy = true});
    auto out = generate(*cached, prompt, 12, greedy);
    REQUIRE(out.size() == 12);
    // Reference: the full forward over prompt + generated-so-far, argmax of the last row. The
    // cached path's logits are another f32 evaluation of the same numbers, so where the top two
    // are closer than rounding the argmax may go either way on some CPU: there the cached token
    // must be within rounding of the full forward's choice, judged on the f64 logits with the
    // bound of tests/rounding.hpp (default_k times the full f32 forward's own error, twice: one
    // for each of the two tokens). A wrong cache picks a token a logit gap (~1e-2) away.
    std::vector<std::int32_t> seq = prompt;
    for (std::size_t i = 0; i < out.size(); ++i) {
      INFO("token " << i);
      auto t = static_cast<std::int64_t>(seq.size());
      tensor ids(seq.data(), seq.size() * 4, dtype::i32, {1, t});
      full->forward(ids, ids);
      exact->forward(ids, ids);
      const auto v = full->vocab();
      const float* last = full->logits().data_as<float>() + (t - 1) * v;
      const double* last64 = exact->logits().data_as<double>() + (t - 1) * v;
      auto ref = static_cast<std::int32_t>(std::max_element(last, last + v) - last);
      const auto rounding = tests::as_accurate_as(std::vector<float>(last, last + v),
                                                  std::vector<float>(last, last + v),
                                                  std::vector<double>(last64, last64 + v));
      INFO("cached " << out[i] << ", full " << ref << "; f64 logits " << last64[out[i]] << " and "
                     << last64[ref] << "; full f32 forward: " << rounding.str());
      CHECK((out[i] == ref || std::abs(last64[ref] - last64[out[i]]) <= 2 * rounding.bound));
      seq.push_back(out[i]);
    }
  }
}

TEST_CASE("generation stops at eos and rejects bad prompts") {
  auto cfg = named_model_config("gpt2-demo", 16).value();
  auto m = make_causal_lm(cfg, {1, 16});
  m->init_weights(1);
  token_sampler greedy({.greedy = true});
  std::vector<std::int32_t> prompt = {1, 2};
  auto first = generate(*m, prompt, 5, greedy);
  REQUIRE(!first.empty());
  auto stopped = generate(*m, prompt, 5, greedy, first[0]);
  CHECK(stopped.size() == 1);
  std::vector<std::int32_t> bad = {99};
  CHECK_THROWS_WITH(generate(*m, bad, 3, greedy),
                    Catch::Contains("outside the model's vocabulary"));
}
