#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <vector>

#include "models/sampling.hpp"

using namespace troupe::models;

TEST_CASE("greedy picks the largest logit") {
  token_sampler s({.greedy = true});
  std::vector<float> l = {0.1f, 2.0f, -1.0f, 1.9f};
  CHECK(s.next(l) == 1);
}

TEST_CASE("sampling follows softmax of logits over temperature") {
  std::vector<float> l = {0.0f, std::log(3.0f)};  // probabilities 1/4 and 3/4
  token_sampler s({.temperature = 1.0}, 7);
  int ones = 0;
  for (int i = 0; i < 20000; ++i) ones += s.next(l);
  // Not rounding: a fixed seed, and 0.02 is 6.5 standard deviations of a binomial frequency
  // over 20000 draws (sqrt(0.75 * 0.25 / 20000) = 0.003).
  CHECK(ones / 20000.0 == Approx(0.75).margin(0.02));
  token_sampler hot({.temperature = 1e6}, 7);  // nearly uniform
  ones = 0;
  for (int i = 0; i < 20000; ++i) ones += hot.next(l);
  CHECK(ones / 20000.0 == Approx(0.5).margin(0.02));
}

TEST_CASE("top-k and top-p keep only the most likely tokens") {
  std::vector<float> l = {3.0f, 2.0f, 1.0f, 0.0f};
  token_sampler k2({.top_k = 2}, 1);
  std::map<int, int> seen;
  for (int i = 0; i < 2000; ++i) ++seen[k2.next(l)];
  CHECK(seen.size() == 2);
  CHECK(seen.count(0) == 1);
  CHECK(seen.count(1) == 1);
  // p(0) = 0.644, p(1) = 0.237: top_p 0.5 keeps only token 0, top_p 0.8 keeps 0 and 1.
  token_sampler p5({.top_p = 0.5}, 1), p8({.top_p = 0.8}, 1);
  std::map<int, int> s5, s8;
  for (int i = 0; i < 2000; ++i) {
    ++s5[p5.next(l)];
    ++s8[p8.next(l)];
  }
  CHECK(s5.size() == 1);
  CHECK(s8.size() == 2);
}

TEST_CASE("bad sampling options are rejected with their name") {
  CHECK_THROWS_WITH(token_sampler({.temperature = 0}), Catch::Contains("temperature"));
  CHECK_THROWS_WITH(token_sampler({.top_p = 1.5}), Catch::Contains("top_p"));
  CHECK_THROWS_WITH(token_sampler({.top_k = -1}), Catch::Contains("top_k"));
}
