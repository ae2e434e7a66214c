// `troupe launch ... -- troupe train --cp 2 --cp-mode ulysses|ring` across real processes: every
// sample's 32 positions split over 2 ranks (Ulysses: models/parallel/context_parallel.hpp), alone,
// under dp 2 and inside 2 pipeline stages (context_pipeline.hpp), train GPT-2 and grouped-query
// Llama with the single-process `troupe train`'s losses as far as f32 rounding goes
// (train_runs.hpp's same_losses against the f64 twin); ring attention in bf16 as accurately as the
// single bf16 run.
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "tests/multirank/train_runs.hpp"

using namespace troupe::tests;

TEST_CASE("Launched Ulysses cp2 and dp2 x cp2 runs train like the single process", "[multirank]") {
  const int steps = 8;
  for (const std::string model : {"gpt2-demo", "llama-tiny"}) {
    INFO(model);
    scratch_dir dir("cp-" + model);
    const reference_losses want = single_and_twin(model, steps, dir.path);
    struct plan_case {
      int ranks;
      std::string name;
      std::vector<std::string> plan;
    };
    for (const auto& p : std::vector<plan_case>{
             {2, "cp2", {"--cp", "2", "--cp-mode", "ulysses"}},
             {4, "dp2cp2", {"--dp", "2", "--cp", "2", "--zero", "1"}},
         }) {
      INFO(p.name);
      std::string out;
      const auto got = launched(p.ranks, model, steps, dir.path, p.name, p.plan, &out);
      CHECK_THAT(out, Catch::Contains("cp2 (ulysses)") && Catch::Contains("(Ulysses, cp 1 of 2)"));
      same_losses(got, want);
    }
  }
}

TEST_CASE("A launched ring cp2 run trains like the single process", "[multirank]") {
  // --cp-mode ring: each rank holds two zigzag chunks of every sample's 32 positions and the
  // attention core passes key/value blocks around the ring (models/layers/ring_attention.hpp).
  const int steps = 8;
  for (const std::string model : {"gpt2-demo", "llama-tiny"}) {
    INFO(model);
    scratch_dir dir("cp-ring-" + model);
    const reference_losses want = single_and_twin(model, steps, dir.path);
    std::string out;
    const auto got =
        launched(2, model, steps, dir.path, "ring-cp2", {"--cp", "2", "--cp-mode", "ring"}, &out);
    CHECK_THAT(out, Catch::Contains("cp2 (ring)") &&
                        Catch::Contains("positions 8-15, 16-23 of each sample (ring attention, "
                                        "zigzag, cp 1 of 2)"));
    same_losses(got, want);
  }
}

TEST_CASE("Launched ring and Ulysses cp2 x pp2 runs train like the single process", "[multirank]") {
  // 4 processes: two pipeline stages, each stage's blocks context parallel over the 2 ranks that
  // hold it (models/parallel/context_pipeline.hpp); 1F1B over 4 microbatches of 2 rows, so the
  // first stage stashes microbatches in flight (with Ulysses, the heads its exchanges keep).
  const int steps = 8;
  for (const std::string model : {"gpt2-demo", "llama-tiny"}) {
    INFO(model);
    scratch_dir dir("cp-pp-" + model);
    const reference_losses want = single_and_twin(model, steps, dir.path);
    for (const std::string mode : {"ring", "ulysses"}) {
      INFO(mode);
      std::string out;
      const auto got =
          launched(4, model, steps, dir.path, "cp2pp2-" + mode,
                   {"--cp", "2", "--pp", "2", "--cp-mode", mode, "--microbatches", "4"}, &out);
      CHECK_THAT(out, Catch::Contains("cp2 (" + mode + ") x pp2") &&
                          Catch::Contains("stage 1 of 2 (blocks ") &&
                          Catch::Contains(", cp 1 of 2)"));
      same_losses(got, want);
    }
  }
}

// Ring attention in bf16 across processes (models/layers/ring_attention.hpp: blocks travel in
// bf16, computed and merged in f32): the rule of tests/multirank/bf16_train.test.cpp, the plan's
// losses and the single-process bf16 run's both against the f64 twin, within default_k.
TEST_CASE("A launched bf16 ring cp2 x pp2 run trains like the single process bf16", "[multirank]") {
  const int steps = 4;
  scratch_dir dir("cp-ring-bf16");
  reference_losses want;
  want.f32 = single("llama-tiny", steps, dir.path, {"--precision", "bf16"}, "single-bf16");
  want.f64 = single("llama-tiny", steps, dir.path, {"--precision", "f64"}, "single-f64");
  REQUIRE(want.f32.size() == static_cast<std::size_t>(steps));
  std::string out;
  const auto got = launched(
      4, "llama-tiny", steps, dir.path, "ring-bf16",
      {"--precision", "bf16", "--cp", "2", "--pp", "2", "--cp-mode", "ring", "--microbatches", "4"},
      &out);
  CHECK_THAT(out, Catch::Contains("ring attention, zigzag, cp 1 of 2), bf16 with f32 master"));
  REQUIRE(got.size() == want.f32.size());
  const auto v = as_accurate_as(got, want.f32, want.f64, default_k);
  if (print_ratios()) std::printf("ratios: ring cp2 x pp2 bf16 losses: %s\n", v.str().c_str());
  INFO("losses: " << v.str());
  CHECK(v.ok());
}
