// Microbatch plans: the slots of the dp group, read in order, are the single-process batch.
#include <catch2/catch.hpp>

#include <algorithm>
#include <random>
#include <stdexcept>
#include <tuple>

#include "scheduler/microbatch.hpp"

using namespace troupe::scheduler;

TEST_CASE("the slots of a step read in order are the single-process batch") {
  for (std::int64_t g = 1; g <= 48; ++g)
    for (int dp = 1; dp <= 6; ++dp)
      for (int m = 1; m <= 6; ++m) {
        if (g < dp * m) continue;
        INFO("global batch " << g << " dp " << dp << " microbatches " << m);
        microbatch_plan plan(g, dp, m);
        for (std::int64_t step : {0, 3}) {
          std::int64_t next = step * g;
          double weights = 0;
          for (int k = 0; k < m; ++k)
            for (int r = 0; r < dp; ++r) {
              auto range = plan.range(r, k, step);
              REQUIRE(range.begin == next);
              REQUIRE(range.size() == plan.size(r, k));
              REQUIRE(range.size() >= 1);
              CHECK(range.size() - g / (dp * m) <= 1);
              next = range.end;
              weights += plan.weight(r, k);
            }
          CHECK(next == (step + 1) * g);
          CHECK(weights == Approx(1.0).epsilon(1e-12));
        }
        std::int64_t lo = g, hi = 0;
        for (int r = 0; r < dp; ++r) {
          lo = std::min(lo, plan.rank_samples(r));
          hi = std::max(hi, plan.rank_samples(r));
        }
        CHECK(hi - lo <= 1);
        CHECK(plan.uniform() == (g % (dp * m) == 0));
      }
}

TEST_CASE("a uniform plan matches single-process gradient accumulation slot by slot") {
  // Single process: batch 4, grad_accum 6 reads micro-batch q as samples [4q, 4q + 4). dp 3 x 2
  // microbatches of 4: rank r's microbatch k is that micro-batch q = k * 3 + r.
  microbatch_plan plan(24, 3, 2);
  REQUIRE(plan.uniform());
  for (int r = 0; r < 3; ++r) {
    CHECK(plan.sizes(r) == std::vector<std::int64_t>{4, 4});
    for (int k = 0; k < 2; ++k) {
      const int q = k * 3 + r;
      CHECK(plan.slot(r, k) == q);
      CHECK(plan.range(r, k) == sample_range{4 * q, 4 * q + 4});
      CHECK(plan.range(r, k, 5) == sample_range{120 + 4 * q, 120 + 4 * q + 4});
    }
  }
}

TEST_CASE("weighted slot losses add up to the single-process mean loss") {
  // Per-sample losses of one step; the single process averages all of them, each rank averages
  // its slots and scales by their weights, and the dp group sums.
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> loss(0.5, 4.0);
  for (auto [g, dp, m] :
       {std::tuple{64, 4, 4}, std::tuple{30, 4, 2}, std::tuple{7, 2, 3}, std::tuple{100, 3, 7}}) {
    INFO("global batch " << g << " dp " << dp << " microbatches " << m);
    std::vector<double> per_sample(g);
    for (auto& l : per_sample) l = loss(rng);
    double single = 0;
    for (double l : per_sample) single += l;
    single /= g;
    microbatch_plan plan(g, dp, m);
    double group = 0;
    for (int r = 0; r < dp; ++r) {
      double rank = 0;
      for (int k = 0; k < m; ++k) {
        auto range = plan.range(r, k);
        double mean = 0;
        for (auto i = range.begin; i < range.end; ++i) mean += per_sample[i];
        mean /= range.size();
        rank += plan.weight(r, k) * mean;
      }
      group += rank;  // the dp allreduce (sum)
    }
    CHECK(group == Approx(single).epsilon(1e-12));
  }
}

TEST_CASE("changing the data-parallel degree keeps the samples of each step") {
  // After a re-plan (a rank lost: dp 4 -> 3 with more microbatches) step 7 still reads the same
  // samples, so a resumed run sees the batches it would have seen.
  auto samples = [](const microbatch_plan& p, std::int64_t step) {
    std::vector<std::int64_t> out;
    for (int k = 0; k < p.microbatches(); ++k)
      for (int r = 0; r < p.dp(); ++r)
        for (auto range = p.range(r, k, step); range.begin < range.end; ++range.begin)
          out.push_back(range.begin);
    return out;
  };
  CHECK(samples(microbatch_plan(48, 4, 2), 7) == samples(microbatch_plan(48, 3, 4), 7));
}

TEST_CASE("microbatch plans reject slots without samples") {
  CHECK_THROWS_WITH(microbatch_plan(5, 2, 3), Catch::Contains("global batch 5 is smaller than dp x "
                                                              "microbatches = 2 x 3"));
  CHECK_THROWS_AS(microbatch_plan(8, 0, 1), std::invalid_argument);
  CHECK_THROWS_AS(microbatch_plan(8, 1, 0), std::invalid_argument);
  CHECK_THROWS_AS(microbatch_plan(8, 2, 2).range(2, 0), std::out_of_range);
}
