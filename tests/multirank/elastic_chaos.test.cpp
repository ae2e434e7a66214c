// The elastic chaos matrix (issue 17, docs/adr/0005): launched runs of 40 steps on the demo model -
// dp2 x pp2, dp2 x tp2 and ZeRO-3 dp4 - where ranks SIGKILL themselves (elastic.chaos_kill, several
// entries) at seeded-random steps and phases: before the forward pass, at the first gradient
// reduction of the backward pass, after AdamW ran in the commit, and during the buddy copy. Each
// loss is recovered by a spare; a later fault may hit the spare that took an earlier place. Every
// run must finish with the fault-free run's losses and final weights and AdamW moments byte for
// byte: both runs are elastic (the same algorithms), a replacement holds the lost rank's group
// ranks so every reduction sums in the same order, its state is a byte copy (a data-parallel
// replica or the buddy's copy of the last replicated step), every rank goes back to that step when
// it is older, and the data of step s is a function of (seed, s).
//
// And the disk fallback: a rank and its buddy killed together leave no copy of the first one's
// ZeRO shard; with a checkpoint of a committed step in checkpoint.dir every rank loads it (spares
// in the lost places) and the steps since run again, to the fault-free run's bytes.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "tests/multirank/elastic_runs.hpp"
#include "tests/multirank/process.hpp"
#include "tests/multirank/train_runs.hpp"

using namespace troupe;
using namespace troupe::tests;

namespace {

constexpr int chaos_steps = 40;
constexpr int replica_interval = 4;

struct fault {
  int rank = 0;
  int step = 0;  // 1-based; for "replicate" the steps done when the copy runs
  std::string phase;
};

// `count` faults at seeded-random steps (spread over [3, 37], at least 4 apart) and phases, each on
// the rank then holding a random position other than 0 (the driver's): a lost position goes to the
// lowest spare left, as plan_recovery gives it, so a later fault can hit a promoted spare.
std::vector<fault> draw_faults(unsigned seed, int positions, int count) {
  std::mt19937 rng(seed);
  const char* phases[] = {"forward", "backward", "optimizer", "replicate"};
  std::vector<int> holder(static_cast<std::size_t>(positions));
  for (int p = 0; p < positions; ++p) holder[static_cast<std::size_t>(p)] = p;
  int next_spare = positions;
  std::vector<fault> out;
  int step = 0;
  for (int i = 0; i < count; ++i) {
    fault f;
    f.phase = phases[rng() % 4];
    // Fault i in [3 + i * 34 / count, 3 + (i + 1) * 34 / count), at least 4 after the last.
    const int lo = 3 + i * 34 / count, hi = 3 + (i + 1) * 34 / count;
    step = std::max(step + 4, lo + static_cast<int>(rng() % static_cast<unsigned>(hi - lo)));
    if (f.phase == "replicate")  // a round runs after every replica_interval-th step
      step = (step + replica_interval - 1) / replica_interval * replica_interval;
    f.step = step;
    const int p = 1 + static_cast<int>(rng() % static_cast<unsigned>(positions - 1));
    f.rank = holder[static_cast<std::size_t>(p)];
    holder[static_cast<std::size_t>(p)] = next_spare++;
    out.push_back(f);
  }
  REQUIRE(out.back().step <= chaos_steps - 3);
  return out;
}

std::string kill_list(const std::vector<fault>& fs) {
  std::string out;
  for (const auto& f : fs) {
    if (!out.empty()) out += ',';
    out += std::to_string(f.rank);
    out += ':';
    out += std::to_string(f.step);
    out += ':';
    out += f.phase;
  }
  return out;
}

std::size_t count_of(const std::string& text, const std::string& needle) {
  std::size_t n = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// The fault-free run of `plan` and the one with the drawn faults, compared byte for byte.
void chaos_run(const std::string& name, const std::string& about, std::vector<std::string> plan,
               int positions, int faults, unsigned seed) {
  scratch_dir dir("elastic-chaos-" + name);
  plan.insert(plan.end(), {"--replica-interval", std::to_string(replica_interval)});
  const auto fs = draw_faults(seed, positions, faults);
  const std::string kills = kill_list(fs);
  INFO("seed " << seed << ", --chaos-kill " << kills);
  run(elastic_argv(positions, faults, dir.path, "clean", plan, chaos_steps), 0);
  auto p = plan;
  p.insert(p.end(), {"--chaos-kill", kills});
  const auto out = run(elastic_argv(positions, faults, dir.path, "chaos", p, chaos_steps), 0);
  // Every fault fired and was recovered from, each by its own generation.
  CHECK(count_of(out, "elastic.chaos_kill: SIGKILL in step") == fs.size());
  CHECK(count_of(out, "took its place at generation") == fs.size());
  CHECK(out.find("took its place at generation " + std::to_string(fs.size())) != std::string::npos);
  same_bits(dir.path, "chaos", "clean");
  std::printf(
      "faults: %zu SIGKILLs (--chaos-kill %s, seed %u) in a %d-step %s run with %d spares -> "
      "survived: %zu recoveries, the losses and final weights and moments equal the fault-free "
      "run's byte for byte\n",
      fs.size(), kills.c_str(), seed, chaos_steps, about.c_str(), faults,
      count_of(out, "took its place at generation"));
}

}  // namespace

TEST_CASE(
    "A dp2 x pp2 run survives SIGKILLs at random steps and phases with the fault-free run's bytes",
    "[multirank][faults][slow]") {
  chaos_run("dp2pp2", "dp2 x pp2", {"--dp", "2", "--pp", "2"}, 4, 3, 17);
}

TEST_CASE(
    "A dp2 x tp2 run survives SIGKILLs at random steps and phases with the fault-free run's bytes",
    "[multirank][faults][slow]") {
  chaos_run("dp2tp2", "dp2 x tp2", {"--dp", "2", "--tp", "2"}, 4, 2, 29);
}

TEST_CASE(
    "A ZeRO-3 dp4 run survives SIGKILLs at random steps and phases with the fault-free run's "
    "bytes",
    "[multirank][faults][slow]") {
  chaos_run("zero3", "ZeRO-3 dp4", {"--dp", "4", "--zero", "3"}, 4, 2, 5);
}

TEST_CASE(
    "A ZeRO-3 run that loses a rank during the buddy copy restores it from the previous round's "
    "replica, bit for bit",
    "[multirank][faults]") {
  // Replicas every 2 steps. Rank 2 dies in the round after step 6, once its parameters went to
  // rank 3's staging copy: that round is not kept anywhere, so rank 3 sends its replica of rank
  // 2's shard from the round of step 4, every survivor goes back to its own snapshot of step 4
  // and steps 5 and 6 run again.
  scratch_dir dir("elastic-chaos-replicate");
  const std::vector<std::string> plan = {"--dp", "4", "--zero", "3", "--replica-interval", "2"};
  run(elastic_argv(4, 1, dir.path, "clean", plan, 10), 0);
  auto p = plan;
  p.insert(p.end(), {"--chaos-kill", "2:6:replicate"});
  const auto out = run(elastic_argv(4, 1, dir.path, "copy", p, 10), 0);
  const auto line = first_line_with(out, "elastic: rank 2 (dp 2 pp 0 tp 0) lost in step 6");
  INFO(out);
  REQUIRE(!line.empty());
  CHECK(line.find("(replicating its state to the buddies") != std::string::npos);
  CHECK(line.find("from rank 3 (its buddy replica of step 4") != std::string::npos);
  CHECK(line.find("going on from step 4, the last replicated (every rank went back from step 6") !=
        std::string::npos);
  same_bits(dir.path, "copy", "clean");
  std::printf(
      "faults: SIGKILL of rank 2 during the buddy copy after step 6, ZeRO-3 dp4 -> "
      "survived: %s\n",
      line.c_str());
}

TEST_CASE(
    "A ZeRO-3 run that loses a rank and its buddy together goes back to its last checkpoint and "
    "ends with the fault-free run's bytes",
    "[multirank][faults]") {
  // Rank 2 holds rank 1's buddy replica; both die before their forward pass of step 7. The last
  // save (--checkpoint-every 4) is of step 4: every rank loads it, spares 4 and 5 in the lost
  // places, and steps 5-7 run again with the batches they had.
  scratch_dir dir("elastic-chaos-disk");
  const std::vector<std::string> plan = {
      "--dp", "4", "--zero", "3", "--replica-interval", "2", "--checkpoint-every", "4"};
  run(elastic_argv(4, 2, dir.path, "clean", plan, 10), 0);
  auto p = plan;
  p.insert(p.end(), {"--chaos-kill", "1:7:forward,2:7:forward"});
  const auto out = run(elastic_argv(4, 2, dir.path, "both", p, 10), 0);
  const auto line =
      first_line_with(out,
                      "elastic: rank 1 (dp 1 pp 0 tp 0) and rank 2 (dp 2 pp 0 tp 0) lost in "
                      "step 7");
  INFO(out);
  REQUIRE(!line.empty());
  CHECK(line.find("a piece and its copy both lost; going back to the checkpoint of step 4 in " +
                  dir.path + "/both") != std::string::npos);
  CHECK(line.find("rank 4 took rank 1's place, rank 5 took rank 2's place at generation 1") !=
        std::string::npos);
  same_bits(dir.path, "both", "clean");
  std::printf(
      "faults: SIGKILL of rank 1 and its buddy rank 2 before step 7, ZeRO-3 dp4, checkpoint every "
      "4 steps -> survived: %s\n",
      line.c_str());
}

TEST_CASE("A run whose driver gives up fails its launch, spares left or not",
          "[multirank][faults]") {
  // Ranks 1 and 2 (a ZeRO-1 shard and its buddy) die together and no checkpoint was saved yet:
  // the driver (rank 0) ends the run naming both. Three spares tolerate three failures, but rank 0
  // is not replaceable: the launch must fail, not count it among them and exit 0.
  scratch_dir dir("elastic-chaos-driver");
  const std::vector<std::string> plan = {"--dp",
                                         "4",
                                         "--zero",
                                         "1",
                                         "--replica-interval",
                                         "1",
                                         "--chaos-kill",
                                         "1:3:forward,2:3:forward"};
  const auto out = run(elastic_argv(4, 3, dir.path, "ends", plan, 6), 1);
  const auto line = first_line_with(out, "elastic: rank 1 (dp 1 pp 0 tp 0) was lost");
  INFO(out);
  REQUIRE(!line.empty());
  CHECK(line.find("rank 2, which holds its buddy replica, was lost too") != std::string::npos);
  CHECK(out.find("every other rank ended well") == std::string::npos);
  std::printf(
      "faults: SIGKILL of rank 1 and its buddy rank 2 with no checkpoint, 3 spares -> "
      "refused: %s\n",
      line.c_str());
}
