// apps/examples/grpo.cpp under `troupe launch -n 1`, as a user runs it: SFT from scratch, then GRPO
// with rollout, reward, reference and trainer actors; its mean reward must rise (issue 19's proof
// of the example), and the weights that sampled each batch must be the trainer's (sync: on-policy,
// nothing clipped) or one step older (async, staleness 1).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "tests/multirank/rl_example.hpp"

using namespace troupe::tests;

namespace {

rl_example_run run_example(const std::vector<std::string>& flags) {
  return run_rl_example(TROUPE_EXAMPLE_GRPO_BIN, "grpo-example", flags);
}

}  // namespace

TEST_CASE("the GRPO example's mean reward rises over its first iterations", "[multirank]") {
  // Seed 1 (the default), 20 iterations of 16 prompts x 8 samples; iterations 1-5 against 16-20.
  // Measured here: 0.441 -> 0.694 (the rise). With --lr 1e-12 (no learning) the same prompts and
  // samples gave 0.427 -> 0.461: the per-iteration mean reward then varies with the prompts drawn
  // (standard deviation ~0.05 over those 20 iterations), so a difference of two means of 5 has a
  // deviation of ~0.03. A margin of 0.15 is ~5 of those and 60% of the rise seen: the test fails
  // without learning (0.034) and passes with it (0.253).
  const rl_example_run r = run_example({"--iterations", "20"});
  INFO(r.output);
  REQUIRE(r.lines.size() == 20);
  const double first = mean_reward(r.lines, 0, 5), last = mean_reward(r.lines, 15, 5);
  std::printf("grpo example: mean reward of iterations 1-5 %.3f, 16-20 %.3f\n", first, last);
  CHECK(last > first + 0.15);
  for (const auto& l : r.lines) {  // sync: batch k sampled by the weights after k steps
    CHECK(l.version == l.iteration - 1);
    CHECK(l.clipped == 0.0);  // on-policy: every ratio is 1 up to rounding
  }
  CHECK_THAT(r.output, Catch::Contains("rollout ") && Catch::Contains("tokens/s"));
}

TEST_CASE("async GRPO samples with weights one step behind and several rollout actors",
          "[multirank]") {
  const rl_example_run r = run_example({"--iterations", "4", "--async", "--rollouts", "2"});
  INFO(r.output);
  REQUIRE(r.lines.size() == 4);
  CHECK_THAT(r.output, Catch::Contains("2 rollout actor(s), async (staleness 1)"));
  bool clipped = false;
  for (const auto& l : r.lines) {
    // Batch k + 1 is sampled during step k + 1, by the weights after k steps.
    CHECK(l.version == std::max(0, l.iteration - 2));
    clipped = clipped || l.clipped > 0;
  }
  CHECK(clipped);  // off-policy batches: the ratio and its clip are at work
}
