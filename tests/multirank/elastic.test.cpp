// Elastic training across real processes (actors/training.hpp, docs/adr/0005): a launched run
// with a spare rank loses a rank holding a piece - SIGKILLed by the drill (elastic.chaos_kill) in
// its forward pass or at its commit, or by this test from outside at whatever point the step has
// reached - and goes on: a spare takes the lost grid position, a surviving data-parallel replica
// sends it the piece's state, the abandoned step runs again.
//
// The claim is bitwise: the run with the loss prints the fault-free run's losses and gradient
// norms and writes its weights and AdamW moments byte for byte. Bitwise is the right bar here
// because the same kernels run in the same order: both runs are elastic (no direct allreduce,
// two-phase steps), the replacement holds the same grid position (the same group ranks, so every
// reduction sums in the same order), its state is a copy of a replica's, which equals the lost
// rank's bit for bit (ZeRO 0: every replica applies the same allreduced gradients), and the data
// of step s is a function of (seed, s). A recovery that replayed a step twice, skipped one,
// restored a stale or half-updated replica, or let a rank commit alone would change the losses
// after it or the weights.
//
// Pieces without a data-parallel replica (a stage or shard of dp 1) come back from buddy
// replicas, every rank going back to the replicated step. Without a spare the run ends naming the
// lost rank and the last committed step, after the surviving replica saved that step; resuming
// from it gives the fault-free weights, bit for bit.
#include <catch2/catch.hpp>

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tests/multirank/elastic_runs.hpp"
#include "tests/multirank/process.hpp"
#include "tests/multirank/train_runs.hpp"

using namespace troupe;
using namespace troupe::tests;
using namespace std::chrono_literals;

TEST_CASE("A dp2 run whose rank dies in its forward pass goes on with a spare, bit for bit",
          "[multirank][faults]") {
  scratch_dir dir("elastic-dp2");
  const std::vector<std::string> plan = {"--dp", "2"};
  run(elastic_argv(2, 1, dir.path, "clean", plan), 0);
  auto plan_kill = plan;
  plan_kill.insert(plan_kill.end(), {"--chaos-kill", "1:3:forward"});
  const auto out = run(elastic_argv(2, 1, dir.path, "killed", plan_kill), 0);
  CHECK(out.find("rank 2 took its place at generation 1") != std::string::npos);
  CHECK(out.find("its state from rank 0") != std::string::npos);
  CHECK(out.find("going on from step 2, the last committed") != std::string::npos);
  CHECK(out.find("every other rank ended well, within the 1 failures --spares allows") !=
        std::string::npos);
  same_bits(dir.path, "killed", "clean");
  survived("SIGKILL of rank 1 (dp 1) before its forward pass of step 3, dp2, 1 spare", out);
}

TEST_CASE(
    "A dp2 x pp2 run loses a stage in its forward pass or at its commit and a spare takes "
    "its place, bit for bit",
    "[multirank][faults]") {
  scratch_dir dir("elastic-pp");
  const std::vector<std::string> plan = {"--dp", "2", "--pp", "2", "--microbatches", "2"};
  run(elastic_argv(4, 1, dir.path, "clean", plan), 0);
  struct drill {
    const char* kill;
    const char* name;
    const char* committed;  // the recovery's "going on from step N"
    const char* what;
  };
  for (const auto& d : {drill{"3:3:forward", "forward", "going on from step 2,",
                              "SIGKILL of rank 3 (dp 1 pp 1) before its forward pass of step 3"},
                        drill{"1:4:commit", "commit", "going on from step 4,",
                              "SIGKILL of rank 1 (dp 0 pp 1) at its commit of step 4, the "
                              "others committing"}}) {
    SECTION(d.name) {
      auto p = plan;
      p.insert(p.end(), {"--chaos-kill", d.kill});
      const auto out = run(elastic_argv(4, 1, dir.path, d.name, p), 0);
      CHECK(out.find("rank 4 took its place at generation 1") != std::string::npos);
      CHECK(out.find(d.committed) != std::string::npos);
      same_bits(dir.path, d.name, "clean");
      survived(std::string(d.what) + ", dp2 x pp2, 1 spare", out);
    }
  }
}

TEST_CASE("A rank SIGKILLed from outside mid-run is replaced by a spare, bit for bit",
          "[multirank][faults]") {
  // Wherever the step is when the signal lands (forward, backward, a collective, the commit, or
  // between steps), the run ends with the fault-free numbers.
  scratch_dir dir("elastic-outside");
  const std::vector<std::string> plan = {"--dp",           "2", "--pp",        "2",
                                         "--microbatches", "2", "--log-every", "1"};
  run(elastic_argv(4, 1, dir.path, "clean", plan, 12), 0);
  child_process p(elastic_argv(4, 1, dir.path, "killed", plan, 12));
  REQUIRE(p.wait_for("step     4/12", 120s));
  // The coordinator's line for rank 2: "rank 2 (host H, pid P) joined".
  const int pid = pid_of_rank(p, 2);
  REQUIRE(pid > 0);
  REQUIRE(::kill(pid, SIGKILL) == 0);
  auto st = p.wait(300s);
  INFO(p.output());
  REQUIRE(st.has_value());
  CHECK(child_process::code(*st) == 0);
  CHECK(p.output().find("rank 4 took its place at generation 1") != std::string::npos);
  same_bits(dir.path, "killed", "clean");
  survived("SIGKILL of rank 2 (dp 1 pp 0) from outside after step 4 was logged, dp2 x pp2, 1 spare",
           p.output());
}

TEST_CASE("A spare passed over by the first recovery takes the place of a rank lost later",
          "[multirank][faults]") {
  // dp2 with spares 2 and 3. Rank 1 dies in step 3: rank 2 takes its place at generation 1, and
  // only the positions' ranks are told, so rank 3 still holds generation 0's layout. Rank 2 is
  // killed after step 6: rank 3 takes its place at generation 2, two generations after its own
  // (the trainer once took only the next one, and the run ended there).
  scratch_dir dir("elastic-twice");
  const std::vector<std::string> plan = {"--dp", "2", "--log-every", "1"};
  run(elastic_argv(2, 2, dir.path, "clean", plan, 10), 0);
  auto killed = plan;
  killed.insert(killed.end(), {"--chaos-kill", "1:3:forward"});
  child_process p(elastic_argv(2, 2, dir.path, "twice", killed, 10));
  REQUIRE(p.wait_for("rank 2 took its place at generation 1", 120s));
  REQUIRE(p.wait_for("step     6/10", 120s));
  const int pid = pid_of_rank(p, 2);
  REQUIRE(pid > 0);
  REQUIRE(::kill(pid, SIGKILL) == 0);
  auto st = p.wait(300s);
  INFO(p.output());
  REQUIRE(st.has_value());
  CHECK(child_process::code(*st) == 0);
  CHECK(p.output().find("rank 3 took its place at generation 2") != std::string::npos);
  same_bits(dir.path, "twice", "clean");
  survived(
      "SIGKILL of rank 1 in step 3, then of its replacement rank 2 after step 6, dp2, 2 spares",
      p.output());
}

TEST_CASE("A SIGSTOPped rank is declared lost, fenced and replaced; its SIGCONT changes nothing",
          "[multirank][faults]") {
  // A hung rank: silent for the heartbeat timeout (3 s), the coordinator declares it lost, the
  // survivors abort their step and a spare takes its place. Woken afterwards, it learns that it
  // was declared lost (its transport fails every peer, its trainer is not in the new generation)
  // and ends; the run's numbers stay the fault-free run's.
  scratch_dir dir("elastic-stop");
  const std::vector<std::string> plan = {"--dp",           "2", "--pp",        "2",
                                         "--microbatches", "2", "--log-every", "1"};
  run(elastic_argv(4, 1, dir.path, "clean", plan, 10), 0);
  child_process p(elastic_argv(4, 1, dir.path, "stopped", plan, 10));
  REQUIRE(p.wait_for("step     3/10", 120s));
  const int pid = pid_of_rank(p, 1);
  REQUIRE(pid > 0);
  REQUIRE(::kill(pid, SIGSTOP) == 0);
  const bool recovered = p.wait_for("rank 4 took its place at generation 1", 120s);
  ::kill(pid, SIGCONT);
  auto st = p.wait(300s);
  INFO(p.output());
  REQUIRE(recovered);
  REQUIRE(st.has_value());
  CHECK(child_process::code(*st) == 0);
  CHECK(p.output().find("no heartbeat for") != std::string::npos);
  same_bits(dir.path, "stopped", "clean");
  survived(
      "SIGSTOP of rank 1 (dp 0 pp 1) after step 3 was logged, SIGCONT after the recovery, "
      "dp2 x pp2, 1 spare",
      p.output());
}

TEST_CASE("Without a spare the run ends naming the lost rank and saves the last committed step",
          "[multirank][faults]") {
  scratch_dir dir("elastic-nospare");
  const std::vector<std::string> plan = {"--dp", "2", "--pp", "2", "--microbatches", "2"};
  run(elastic_argv(4, 1, dir.path, "clean", plan), 0);
  auto p = plan;
  p.insert(p.end(), {"--chaos-kill", "3:4:forward"});
  const auto out = run(elastic_argv(4, 0, dir.path, "lost", p), 1);
  const auto line = first_line_with(out, "elastic: rank 3 (dp 1 pp 1 tp 0) was lost");
  REQUIRE(!line.empty());
  CHECK(line.find("no spare rank is left; lost in step 4") != std::string::npos);
  CHECK(line.find("the last committed step is 3; its checkpoint is in " + dir.path + "/lost") !=
        std::string::npos);
  std::printf("faults: SIGKILL of rank 3 in step 4, dp2 x pp2, no spare -> refused: %s\n",
              line.c_str());
  // The checkpoint is step 3 exactly: resumed to step 6 (elastic, the same algorithms), the run
  // writes the fault-free run's weights and moments byte for byte.
  auto r = plan;
  r.insert(r.end(), {"--resume", dir.path + "/lost"});
  run(elastic_argv(4, 0, dir.path, "resumed", r), 0);
  const auto clean = numbers_of(dir.path + "/clean.json");
  REQUIRE(clean.size() == 6);
  CHECK(numbers_of(dir.path + "/resumed.json") ==
        std::vector<std::string>(clean.begin() + 3, clean.end()));
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    INFO(f);
    CHECK(file_bytes(dir.path + "/resumed/" + f) == file_bytes(dir.path + "/clean/" + f));
  }
}

TEST_CASE(
    "Stages and tensor shards without a data-parallel replica come back from buddy "
    "replicas, bit for bit",
    "[multirank][faults]") {
  // dp 1: no survivor holds the lost piece but its buddy (the next grid position), which keeps a
  // copy of it every elastic.replica_interval steps. Every rank goes back to that step (its own
  // snapshot) and the steps since run again with the batches they had, so the numbers stay the
  // fault-free run's.
  scratch_dir dir("elastic-buddy");
  struct drill {
    const char* name;
    std::vector<std::string> plan;
    const char* kill;
    const char* from;  // the recovery line's "going on from step N, ..."
    const char* what;
  };
  const std::vector<std::string> pp = {"--pp", "2", "--microbatches", "2", "--replica-interval",
                                       "2"};
  const std::vector<std::string> tp = {"--tp", "2", "--replica-interval", "1"};
  for (const auto& d :
       {drill{"pp-forward", pp, "1:4:forward",
              "going on from step 2, the last replicated (every rank went back from step 3",
              "SIGKILL of rank 1 (pp 1) before its forward pass of step 4, pp2, replicas every 2 "
              "steps"},
        drill{"pp-commit", pp, "1:5:commit",
              "going on from step 4, the last replicated (every rank went back from step 5",
              "SIGKILL of rank 1 (pp 1) at its commit of step 5, pp2, replicas every 2 steps"},
        drill{"tp-forward", tp, "1:3:forward", "going on from step 2, the last committed",
              "SIGKILL of rank 1 (tp 1) before its forward pass of step 3, tp2, replicas every "
              "step"}}) {
    SECTION(d.name) {
      run(elastic_argv(2, 1, dir.path, std::string(d.name) + "-clean", d.plan, 8), 0);
      auto p = d.plan;
      p.insert(p.end(), {"--chaos-kill", d.kill});
      const auto out = run(elastic_argv(2, 1, dir.path, d.name, p, 8), 0);
      CHECK(out.find("rank 2 took its place at generation 1") != std::string::npos);
      CHECK(out.find("its state from rank 0 (its buddy replica of step") != std::string::npos);
      CHECK(out.find(d.from) != std::string::npos);
      same_bits(dir.path, d.name, std::string(d.name) + "-clean");
      survived(std::string(d.what) + ", 1 spare", out);
    }
  }
}
