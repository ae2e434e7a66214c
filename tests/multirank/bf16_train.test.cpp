// `troupe train --precision bf16` under a plan across real processes: tensor shards (tp2 + SP)
// and pipeline stages with data parallelism (dp2 x pp2) compute in bf16 with f32 master weights
// (models/parallel/mixed_piece.hpp) and train as accurately as the single-process bf16 trainer.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "tests/multirank/train_runs.hpp"

using namespace troupe::tests;

// The rule of models/parallel/mixed_plans.test.cpp: the plan's losses and the single process's
// bf16 losses both against the f64 twin, the plan's error within default_k (8) times the single
// process's: bf16 rounds every activation to 8 bits in both runs, so their errors are alike
// (measured ratios 0.7 to 1.1 here, the errors ~2e-3), while a plan that drops a reduction or a
// microbatch is off by 0.05 and more (in-process: 20 to 35 times the single process's error).
// The CLI's twin starts from the unrounded f32 init, the bf16 runs from its rounding; both bf16
// runs carry that offset alike.
TEST_CASE("Launched bf16 runs under tp2 with SP and dp2 x pp2 train like the single process bf16",
          "[multirank]") {
  const int steps = 4;
  scratch_dir dir("bf16");
  reference_losses want;
  want.f32 = single("gpt2-demo", steps, dir.path, {"--precision", "bf16"}, "single-bf16");
  want.f64 = single("gpt2-demo", steps, dir.path, {"--precision", "f64"}, "single-f64");
  REQUIRE(want.f32.size() == static_cast<std::size_t>(steps));
  struct plan_case {
    int ranks;
    std::string name;
    std::vector<std::string> plan;
  };
  for (const auto& p : std::vector<plan_case>{
           {2, "tp2sp", {"--precision", "bf16", "--tp", "2", "--sp"}},
           {4, "dp2pp2", {"--precision", "bf16", "--dp", "2", "--pp", "2", "--microbatches", "2"}},
       }) {
    INFO(p.name);
    std::string out;
    const auto got = launched(p.ranks, "gpt2-demo", steps, dir.path, p.name, p.plan, &out);
    CHECK_THAT(out, Catch::Contains("bf16 with f32 master weights"));
    REQUIRE(got.size() == want.f32.size());
    const auto v = as_accurate_as(got, want.f32, want.f64, default_k);
    if (print_ratios())
      std::printf("ratios: %s bf16 losses: %s\n", p.name.c_str(), v.str().c_str());
    INFO("losses: " << v.str());
    CHECK(v.ok());
  }
}

TEST_CASE("A launched plan refuses f16 naming train.precision", "[multirank][faults]") {
  scratch_dir dir("f16");
  std::vector<std::string> argv =
      launch_argv(2, "gpt2-demo", 2, dir.path, "tp2f16", {"--precision", "f16", "--tp", "2"});
  child_process p(argv);
  using namespace std::chrono_literals;
  auto st = p.wait(120s);
  INFO(p.output());
  REQUIRE(st.has_value());
  CHECK(child_process::code(*st) != 0);
  const auto said = p.lines_with("train.precision f16");
  REQUIRE(!said.empty());
  std::printf("faults: --precision f16 under --tp 2 -> refused: %s\n", said.front().c_str());
}
