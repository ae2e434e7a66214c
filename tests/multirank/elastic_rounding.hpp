// Launched elastic runs whose plan changes (a shrink, a growth back): the launch line with
// `troupe launch --min-ranks`, the f64 twin of the runs, and the judgement of a run against its
// fault-free run by rounding (tests/rounding.hpp; elastic_shrink.test.cpp says why).
#pragma once

#include <catch2/catch.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "tests/multirank/elastic_runs.hpp"
#include "tests/multirank/same_weights.hpp"
#include "tests/multirank/train_runs.hpp"

namespace troupe::tests {

// elastic_argv with no spare and `troupe launch --min-ranks min` (which tells troupe train its
// elastic.min_ranks).
inline std::vector<std::string> shrink_argv(int n, int min, const std::string& dir,
                                            const std::string& name,
                                            const std::vector<std::string>& plan, int steps = 6) {
  auto argv = elastic_argv(n, 0, dir, name, plan, steps);
  argv.insert(argv.begin() + 4, {"--min-ranks", std::to_string(min)});
  return argv;
}

// The f64 twin of the runs (the single process: exact arithmetic does not depend on the plan),
// its checkpoint in dir/exact and its losses in dir/exact.json.
inline std::vector<double> exact_run(const std::string& dir, int steps = 6) {
  return single("gpt2-demo", steps, dir, {"--checkpoint-dir", dir + "/exact", "--precision", "f64"},
                "exact");
}

// The run `name` is the fault-free run `clean` up to the rounding of its changed plan: its losses
// (a few scalars along a trajectory: trajectory_k) and its final weights (all together:
// default_k) as accurate as clean's against the f64 twin.
inline void same_by_rounding(const std::string& dir, const std::string& name,
                             const std::string& clean, const std::vector<double>& exact) {
  const auto got = losses(dir + "/" + name + ".json"), ref = losses(dir + "/" + clean + ".json");
  REQUIRE(got.size() == exact.size());
  REQUIRE(ref.size() == exact.size());
  const auto l = as_accurate_as(got, ref, exact, trajectory_k);
  INFO("losses: " << l.str());
  CHECK(l.ok());
  const auto w = compare_weights(dir + "/" + name, dir + "/" + clean, dir + "/exact");
  INFO("weights: " << w.str());
  CHECK(w.ok());
  std::printf("shrink %s: losses %s; weights %s\n", name.c_str(), l.str().c_str(),
              w.all.str().c_str());
}

}  // namespace troupe::tests
