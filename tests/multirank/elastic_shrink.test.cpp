// Elastic runs that shrink onto their survivors (elastic.min_ranks; docs/adr/0005, "Shrinking"):
// a launched run with no spare loses a rank - SIGKILLed by the drill (elastic.chaos_kill) before
// its forward pass or at its commit - and goes on without a restart under a smaller plan: the
// model pieces (pp x tp) stay, dp goes down, each replica accumulates more micro-batches so that
// every step still reads the same global batch (the data of step s is a function of (seed, s)).
//
// The claim is equality up to rounding, not bit for bit: after the shrink each step's gradient is
// summed in another order (dp2 x 2 micro-batches: two local sums then a two-rank allreduce; dp1 x
// 4: one local sum of four), so the losses and weights differ from the fault-free run's by f32
// rounding. They are judged by tests/rounding.hpp's rule, as the plan matrix judges a plan against
// the single process: the shrunk run (got) must be as accurate as the fault-free run (ref) against
// the same run in f64 (exact: the single process with --precision f64, the same weights, data and
// schedule). A wrong continuation - a step's update missed or applied twice, a micro-batch left
// out, a replica's state that is not the committed one - moves the weights by about lr (1e-3)
// and the losses by 1e-3 relative, 10 to 1000 times the bound: the test checks that the
// fault-free run one step shorter fails the same rule.
#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/multirank/elastic_rounding.hpp"
#include "tests/multirank/elastic_runs.hpp"
#include "tests/multirank/process.hpp"
#include "tests/multirank/same_weights.hpp"
#include "tests/multirank/train_runs.hpp"

using namespace troupe;
using namespace troupe::tests;

TEST_CASE(
    "A dp2 x pp2 run with no spare loses a stage in its forward pass or at its commit, "
    "shrinks to dp1 x pp2 and ends equal to the fault-free run by rounding",
    "[multirank][faults]") {
  scratch_dir dir("elastic-shrink");
  const std::vector<std::string> plan = {"--dp", "2", "--pp", "2", "--microbatches", "2"};
  const auto exact = exact_run(dir.path);
  run(elastic_argv(4, 0, dir.path, "clean", plan), 0);
  // The rule tells a wrong continuation apart: the fault-free run one step shorter (an update
  // missed) is far outside it.
  {
    run(elastic_argv(4, 0, dir.path, "short", plan, 5), 0);
    const auto w = compare_weights(dir.path + "/short", dir.path + "/clean", dir.path + "/exact");
    INFO("one step shorter: " << w.str());
    CHECK_FALSE(w.ok());
  }
  struct drill {
    const char* kill;
    const char* name;
    const char* from;  // the recovery's "going on from step N"
    const char* idle;  // the surviving replica of the other stage, idle as a spare
    const char* what;
  };
  for (const auto& d : {drill{"3:3:forward", "forward", "going on from step 2, the last committed",
                              "idle as spares: rank 2",
                              "SIGKILL of rank 3 (dp 1 pp 1) before its forward pass of step 3"},
                        drill{"1:4:commit", "commit", "going on from step 4, the last committed",
                              "idle as spares: rank 2",
                              "SIGKILL of rank 1 (dp 0 pp 1) at its commit of step 4, the "
                              "others committing"}}) {
    SECTION(d.name) {
      auto p = plan;
      p.insert(p.end(), {"--chaos-kill", d.kill});
      const auto out = run(shrink_argv(4, 2, dir.path, d.name, p), 0);
      CHECK(out.find("no spare left: shrank dp2 x pp2 -> dp1 x pp2, micro-batches per replica "
                     "(gradient accumulation) 2 -> 4, the global batch of 8 samples kept") !=
            std::string::npos);
      CHECK(out.find(d.from) != std::string::npos);
      CHECK(out.find(d.idle) != std::string::npos);
      CHECK(out.find("within the 2 failures --spares and --min-ranks allow") != std::string::npos);
      same_by_rounding(dir.path, d.name, "clean", exact);
      survived(std::string(d.what) + ", dp2 x pp2, no spare, min_ranks 2", out);
    }
  }
}

TEST_CASE("A dp4 run with no spare loses a replica and shrinks to dp2, equal by rounding",
          "[multirank][faults]") {
  // 3 survivors: dp3 would split the 4 micro-batch slots unevenly, so dp2 with 2 micro-batches
  // each; the third survivor idles.
  scratch_dir dir("elastic-shrink-dp4");
  const std::vector<std::string> plan = {"--dp", "4"};
  const auto exact = exact_run(dir.path);
  run(elastic_argv(4, 0, dir.path, "clean", plan), 0);
  auto p = plan;
  p.insert(p.end(), {"--chaos-kill", "2:3:forward"});
  const auto out = run(shrink_argv(4, 2, dir.path, "killed", p), 0);
  CHECK(out.find("shrank dp4 -> dp2, micro-batches per replica (gradient accumulation) 1 -> 2") !=
        std::string::npos);
  CHECK(out.find("idle as spares: rank 3") != std::string::npos);
  same_by_rounding(dir.path, "killed", "clean", exact);
  survived("SIGKILL of rank 2 (dp 2) before its forward pass of step 3, dp4, no spare", out);
}

TEST_CASE(
    "An interleaved dp3 x pp2 run shrinks to micro-batches its schedule runs, equal by rounding",
    "[multirank][faults]") {
  // 6 slots (dp3 x 2 micro-batches): dp2 would take 3 micro-batches each, which the interleaved
  // schedule refuses (a multiple of pp = 2), so every survivor's rebuilt piece failed and the run
  // ended; dp1 x pp2 takes 6.
  scratch_dir dir("elastic-shrink-interleaved");
  const std::vector<std::string> plan = {"--dp",
                                         "3",
                                         "--pp",
                                         "2",
                                         "--microbatches",
                                         "2",
                                         "--schedule",
                                         "interleaved",
                                         "--virtual-stages",
                                         "2",
                                         "--batch",
                                         "12"};
  const auto exact = single(
      "gpt2-demo", 6, dir.path,
      {"--checkpoint-dir", dir.path + "/exact", "--precision", "f64", "--batch", "12"}, "exact");
  run(elastic_argv(6, 0, dir.path, "clean", plan), 0);
  auto p = plan;
  p.insert(p.end(), {"--chaos-kill", "5:3:forward"});
  const auto out = run(shrink_argv(6, 2, dir.path, "killed", p), 0);
  CHECK(out.find("shrank dp3 x pp2 -> dp1 x pp2, micro-batches per replica (gradient "
                 "accumulation) 2 -> 6") != std::string::npos);
  same_by_rounding(dir.path, "killed", "clean", exact);
  survived(
      "SIGKILL of rank 5 (dp 2 pp 1) before its forward pass of step 3, dp3 x pp2 "
      "interleaved, no spare",
      out);
}

TEST_CASE("Below elastic.min_ranks the run ends naming min_ranks and saves the last committed step",
          "[multirank][faults]") {
  scratch_dir dir("elastic-shrink-min");
  const std::vector<std::string> plan = {"--dp", "2", "--pp", "2", "--microbatches", "2"};
  auto p = plan;
  p.insert(p.end(), {"--chaos-kill", "3:4:forward"});
  // min_ranks 3: dp1 x pp2 (2 ranks) is the most the 3 survivors allow.
  const auto out = run(shrink_argv(4, 3, dir.path, "lost", p), 1);
  const auto line = first_line_with(out, "elastic: rank 3 (dp 1 pp 1 tp 0) was lost");
  REQUIRE(!line.empty());
  CHECK(line.find("at most dp1 x pp2 (2 ranks), below elastic.min_ranks (--min-ranks) 3") !=
        std::string::npos);
  CHECK(line.find("the last committed step is 3; its checkpoint is in " + dir.path + "/lost") !=
        std::string::npos);
  CHECK(std::filesystem::exists(dir.path + "/lost/model.safetensors"));
  std::printf("faults: SIGKILL of rank 3 in step 4, dp2 x pp2, min_ranks 3 -> refused: %s\n",
              line.c_str());
}

TEST_CASE(
    "A dp4 ZeRO 1 or ZeRO 3 run with no spare reshards its shards onto dp2, the lost one from "
    "its buddy, equal by rounding",
    "[multirank][faults]") {
  // No survivor holds a lost rank's shard but its buddy (elastic.replica_interval). Every survivor
  // puts the whole state of the last replicated step together (its own snapshot, the buddy
  // holder's copy of the lost shard) and the new dp ranks take their shards of it; the steps since
  // that step run again under the new plan.
  scratch_dir dir("elastic-shrink-zero");
  const auto exact = exact_run(dir.path);
  struct drill {
    const char* name;
    std::vector<std::string> plan;
    const char* kill;
    const char* how;   // the recovery line's account of the state
    const char* from;  // and the step it goes on from
    const char* what;
  };
  for (const auto& d :
       {drill{"zero1",
              {"--dp", "4", "--zero", "1", "--replica-interval", "1"},
              "2:3:forward",
              "the ZeRO-1 shards of step 2 resharded onto the new dp",
              "going on from step 2, the last committed",
              "SIGKILL of rank 2 (dp 2) before its forward pass of step 3, dp4 ZeRO 1, replicas "
              "every step, no spare"},
        drill{"zero3",
              {"--dp", "4", "--zero", "3", "--replica-interval", "2"},
              "1:4:commit",
              "the ZeRO-3 shards of step 2 resharded onto the new dp",
              "going on from step 2, the last replicated (every rank went back from step 4",
              "SIGKILL of rank 1 (dp 1) at its commit of step 4, dp4 ZeRO 3, replicas every 2 "
              "steps, no spare"}}) {
    SECTION(d.name) {
      const std::string clean = std::string(d.name) + "-clean";
      run(elastic_argv(4, 0, dir.path, clean, d.plan), 0);
      auto p = d.plan;
      p.insert(p.end(), {"--chaos-kill", d.kill});
      const auto out = run(shrink_argv(4, 2, dir.path, d.name, p), 0);
      CHECK(out.find("shrank dp4 -> dp2, micro-batches per replica (gradient accumulation) 1 -> "
                     "2") != std::string::npos);
      CHECK(out.find(d.how) != std::string::npos);
      CHECK(out.find(d.from) != std::string::npos);
      same_by_rounding(dir.path, d.name, clean, exact);
      survived(d.what, out);
    }
  }
}
