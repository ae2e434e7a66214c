// ZeRO 1-3 under elastic runs across real processes (actors/training.hpp, docs/adr/0005): a
// launched dp4 run shards its optimizer state (ZeRO 1, 2) or its parameters too (ZeRO 3), so no
// survivor holds a lost rank's shard but its buddy (the next grid position), which keeps a copy
// of it every elastic.replica_interval steps. A spare takes the lost position, the buddy sends it
// the shard (parameters, m and v) over UCX, every rank goes back to the replicated step where it
// is older than the last committed one, and the steps since run again.
//
// The claim is bitwise, as in elastic.test.cpp: both runs are elastic (the same algorithms: no
// direct allreduce, two-phase steps, ZeRO 1 and 2 gathering the parameters at the start of the
// next step), the replacement holds the lost rank's dp rank (its shard's buckets and chunks, every
// reduce-scatter and all-gather in the same order), its shard is a byte copy of what the lost
// rank held at the replicated step, and the data of step s is a function of (seed, s). A stale or
// half-updated shard, a step replayed twice or skipped, or a survivor left ahead of the others
// would change the losses after the loss or the weights.
//
// Losing a rank and its buddy at once leaves no copy of the first one's shard: the run ends
// naming both.
#include <catch2/catch.hpp>

#include <signal.h>

#include <chrono>
#include <string>
#include <vector>

#include "tests/multirank/elastic_runs.hpp"
#include "tests/multirank/process.hpp"
#include "tests/multirank/train_runs.hpp"

using namespace troupe;
using namespace troupe::tests;
using namespace std::chrono_literals;

namespace {

struct drill {
  const char* name;
  const char* kill;   // --chaos-kill RANK:STEP:PHASE
  const char* shard;  // the recovery line's "its ZeRO-z shard (dp rank r of 4 ..." and donor
  const char* from;   // its "going on from step N, ..."
  const char* what;
};

// The fault-free run of `plan`, then each drill's run with its kill, each checked bit for bit.
void drills(const std::string& scratch_name, const std::vector<std::string>& plan,
            const std::vector<drill>& ds, const std::string& about) {
  scratch_dir dir(scratch_name);
  run(elastic_argv(4, 1, dir.path, "clean", plan, 8), 0);
  for (const auto& d : ds) {
    SECTION(d.name) {
      auto p = plan;
      p.insert(p.end(), {"--chaos-kill", d.kill});
      const auto out = run(elastic_argv(4, 1, dir.path, d.name, p, 8), 0);
      CHECK(out.find("rank 4 took its place at generation 1") != std::string::npos);
      CHECK(out.find(d.shard) != std::string::npos);
      CHECK(out.find(d.from) != std::string::npos);
      same_bits(dir.path, d.name, "clean");
      survived(std::string(d.what) + ", " + about, out);
    }
  }
}

}  // namespace

TEST_CASE(
    "A dp4 ZeRO-1 run loses a rank in its forward pass or at its commit and its shard comes "
    "back from the buddy, bit for bit",
    "[multirank][faults]") {
  // Replicas every step: a loss before the commit goes on from the last committed step; one at
  // the commit (the others committed, the lost rank did not) goes back one step.
  drills("elastic-zero1", {"--dp", "4", "--zero", "1", "--replica-interval", "1"},
         {drill{"forward", "2:3:forward",
                "its ZeRO-1 shard (dp rank 2 of 4: parameters, m and v) from rank 3 (its buddy "
                "replica of step 2",
                "going on from step 2, the last committed",
                "SIGKILL of rank 2 (dp 2) before its forward pass of step 3"},
          drill{"commit", "1:4:commit",
                "its ZeRO-1 shard (dp rank 1 of 4: parameters, m and v) from rank 2 (its buddy "
                "replica of step 3",
                "going on from step 3, the last replicated (every rank went back from step 4",
                "SIGKILL of rank 1 (dp 1) at its commit of step 4, the others committing"}},
         "dp4 ZeRO-1, replicas every step, 1 spare");
}

TEST_CASE("A dp4 ZeRO-2 run loses a rank in its forward pass and goes on bit for bit",
          "[multirank][faults]") {
  drills("elastic-zero2", {"--dp", "4", "--zero", "2", "--replica-interval", "1"},
         {drill{"forward", "3:3:forward",
                "its ZeRO-2 shard (dp rank 3 of 4: parameters, m and v) from rank 0 (its buddy "
                "replica of step 2",
                "going on from step 2, the last committed",
                "SIGKILL of rank 3 (dp 3) before its forward pass of step 3"}},
         "dp4 ZeRO-2, replicas every step, 1 spare");
}

TEST_CASE(
    "A dp4 ZeRO-3 run loses a parameter shard in its forward pass or at its commit and every "
    "rank goes back to the buddy replicas' step, bit for bit",
    "[multirank][faults]") {
  // Replicas every 2 steps: the lost shard is of the last replicated step, older than the last
  // committed one; every survivor goes back to its own snapshot and the steps since run again.
  drills("elastic-zero3", {"--dp", "4", "--zero", "3", "--replica-interval", "2"},
         {drill{"forward", "3:4:forward",
                "its ZeRO-3 shard (dp rank 3 of 4: parameters, m and v) from rank 0 (its buddy "
                "replica of step 2",
                "going on from step 2, the last replicated (every rank went back from step 3",
                "SIGKILL of rank 3 (dp 3) before its forward pass of step 4"},
          drill{"commit", "2:5:commit",
                "its ZeRO-3 shard (dp rank 2 of 4: parameters, m and v) from rank 3 (its buddy "
                "replica of step 4",
                "going on from step 4, the last replicated (every rank went back from step 5",
                "SIGKILL of rank 2 (dp 2) at its commit of step 5, the others committing"}},
         "dp4 ZeRO-3, replicas every 2 steps, 1 spare");
}

TEST_CASE("A ZeRO-1 run that loses a rank and its buddy at once ends naming both",
          "[multirank][faults]") {
  // Rank 2 holds rank 1's buddy replica: with both gone no copy of rank 1's shard is left. Killed
  // together from outside, they may be seen lost in either order; either way the run ends with
  // the recovery plan's error naming both, not with a failed transfer.
  scratch_dir dir("elastic-zero-buddy");
  const std::vector<std::string> plan = {"--dp", "4",           "--zero", "1", "--replica-interval",
                                         "1",    "--log-every", "1"};
  child_process p(elastic_argv(4, 1, dir.path, "lost", plan, 12));
  REQUIRE(p.wait_for("step     3/12", 120s));
  const std::vector<int> pids = {pid_of_rank(p, 1), pid_of_rank(p, 2)};
  REQUIRE(pids[0] > 0);
  REQUIRE(pids[1] > 0);
  for (int pid : pids) REQUIRE(::kill(pid, SIGKILL) == 0);
  auto st = p.wait(300s);
  INFO(p.output());
  REQUIRE(st.has_value());
  CHECK(child_process::code(*st) == 1);
  const auto line = first_line_with(p.output(), "elastic: rank 1 (dp 1 pp 0 tp 0) was lost");
  REQUIRE(!line.empty());
  CHECK(line.find("no data-parallel replica (parallel.zero 1 shards its state), and rank 2, which "
                  "holds its buddy replica, was lost too") != std::string::npos);
  CHECK(line.find("the last committed step is") != std::string::npos);
  std::printf(
      "faults: SIGKILL of rank 1 and its buddy rank 2 after step 3, dp4 ZeRO-1 -> "
      "refused: %s\n",
      line.c_str());
}
