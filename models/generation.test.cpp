#include <catch2/catch.hpp>

#include <algorithm>

#include "models/generation.hpp"
#include "models/trainer.hpp"

using namespace troupe;
using namespace troupe::models;

TEST_CASE("Greedy generation with the kv cache equals re-running the whole sequence", "[cpu]") {
  for (const char* size : {"gpt2-demo", "llama-tiny"}) {
    INFO(size);
    auto cfg = named_model_config(size, 40).value();
    auto cached = make_causal_lm(cfg, {1, 32});
    auto full = make_causal_lm(cfg, {1, 32});
    cached->init_weights(4);
    full->init_weights(4);
    std::vector<std::int32_t> prompt = {3, 14, 15, 9, 2};
    token_sampler greedy({.greedy = true});
    auto out = generate(*cached, prompt, 12, greedy);
    REQUIRE(out.size() == 12);
    // Reference: the full forward over prompt + generated-so-far, argmax of the last row.
    std::vector<std::int32_t> seq = prompt;
    for (std::size_t i = 0; i < out.size(); ++i) {
      auto t = static_cast<std::int64_t>(seq.size());
      tensor ids(seq.data(), seq.size() * 4, dtype::i32, {1, t});
      full->forward(ids, ids);
      const float* last = full->logits().data_as<float>() + (t - 1) * full->vocab();
      auto ref = static_cast<std::int32_t>(std::max_element(last, last + full->vocab()) - last);
      CHECK(out[i] == ref);
      seq.push_back(ref);
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
