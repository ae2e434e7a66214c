// Hybrid-parallel training across real processes, beside the plan matrix (plan_matrix.test.cpp):
// activation recompute under a plan, plans refused naming the setting, a checkpoint written under
// one plan loaded under another, a rank killed mid-run, and training with memory tiers (GPT-2 and
// Llama).
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "tests/multirank/process.hpp"
#include "tests/multirank/train_runs.hpp"

using namespace troupe::tests;
using namespace std::chrono_literals;

// train.recompute under a plan: pipeline stages stash only their input and run forward again,
// tensor shards recompute each block; the losses equal the single process's without recompute as
// far as f32 rounding goes (same_losses: as accurate as it against its f64 twin).
TEST_CASE("Pipeline and tensor parallel runs with activation recompute match the single process",
          "[multirank][slow]") {
  const int steps = 4;
  auto dir = scratch("recompute");
  auto want = single_and_twin("gpt2-demo", steps, dir);
  same_losses(launched(2, "gpt2-demo", steps, dir, "pp2rc",
                       {"--pp", "2", "--microbatches", "4", "--schedule", "gpipe", "--recompute"}),
              want);
  same_losses(launched(2, "gpt2-demo", steps, dir, "tp2rc", {"--tp", "2", "--sp", "--recompute"}),
              want);
  std::filesystem::remove_all(dir);
}

TEST_CASE("A plan the model or the job cannot take is refused naming the setting", "[multirank]") {
  struct bad_plan {
    std::string model;
    std::vector<std::string> plan;
    std::string says;
  };
  for (const auto& b : std::vector<bad_plan>{
           {"gpt2-demo", {"--dp", "4"}, "but the job has 2 ranks"},
           {"llama-tiny", {"--pp", "2", "--zero", "3"}, "parallel.zero 3"},
           {"gpt2-demo", {"--pp", "2", "--zero", "3"}, "parallel.zero 3"},
       }) {
    std::vector<std::string> a = {troupe_bin, "launch",  "-n",
                                  "2",        "--job",   "hybrid-bad-" + std::to_string(::getpid()),
                                  "--",       troupe_bin};
    auto flags = run_flags(b.model, 2);
    a.insert(a.end(), flags.begin(), flags.end());
    a.insert(a.end(), b.plan.begin(), b.plan.end());
    child_process p(a);
    auto st = p.wait(120s);
    INFO(p.output());
    REQUIRE(st.has_value());
    CHECK(child_process::code(*st) != 0);
    CHECK(!p.lines_with(b.says).empty());
  }
}

// The engine's settings (parallel.dp_bucket_bytes, dp_overlap, pipe_p2p, pipe_trace) travel with
// the run's settings from the driver to every trainer: rank 1's stage traces its steps where the
// prefix says, and dp 2 with 64 KiB buckets reduced after backward (a job file) trains to the same
// losses as with the default bucket and overlap, bit for bit.
TEST_CASE("The engine settings of a launched run reach every rank", "[multirank]") {
  scratch_dir dir("engine");
  const std::string trace = dir.path + "/trace";
  std::string out;
  launched(2, "gpt2-demo", 2, dir.path, "pp2",
           {"--pp", "2", "--microbatches", "2", "--pipe-p2p", "batched", "--pipe-trace", trace},
           &out);
  CHECK_THAT(out, Catch::Contains("microbatches, recompute none, pipe p2p batched"));
  for (int stage : {0, 1}) {
    INFO("stage " << stage);
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(dir.path))
      if (e.path().filename().string().rfind("trace.stage" + std::to_string(stage) + ".", 0) == 0)
        files.push_back(e.path().string());
    REQUIRE(files.size() == 1);
    std::ifstream in(files[0]);
    std::string line;
    int walls = 0;  // one "<step> wall ..." line per step
    while (std::getline(in, line))
      if (line.find(" wall ") != std::string::npos) ++walls;
    CHECK(walls == 2);
  }
  const std::string job = dir.path + "/job.toml";
  std::ofstream(job) << "[parallel]\ndp = 2\ndp_overlap = false\ndp_bucket_bytes = \"64K\"\n";
  const auto defaults = launched(2, "gpt2-demo", 3, dir.path, "dp2", {"--dp", "2"});
  const auto small = launched(2, "gpt2-demo", 3, dir.path, "dp2-small", {"--config", job}, &out);
  CHECK_THAT(out, Catch::Contains("dp buckets 65536 bytes, dp overlap off"));
  REQUIRE(defaults.size() == 3);
  CHECK(small == defaults);
}

TEST_CASE("A checkpoint written under one plan continues under another", "[multirank][slow]") {
  scratch_dir dir("ckpt");
  // Written under tensor shards or pipeline stages (gathered to HF layout on save), then one step
  // from it in one process and under another plan: the first losses (the loss of the saved weights
  // on the same batch) agree as far as f32 rounding goes (same_losses; the f64 twin reads the f32
  // weights exactly). One loss, so its f32 error may be near zero by chance: rounding.hpp's floor
  // of a few ulps of the loss then bounds it.
  struct crossing {
    std::string name;
    std::vector<std::string> write, read;
  };
  const std::vector<crossing> crossings = {
      {"tp2-dp2", {"--tp", "2"}, {"--dp", "2"}},
      {"pp2-tp2", {"--pp", "2", "--microbatches", "2"}, {"--tp", "2", "--sp"}},
  };
  for (const char* model : {"gpt2-demo", "llama-tiny"}) {
    for (const auto& x : crossings) {
      INFO(model << " " << x.name);
      const std::string ck = dir.path + "/" + model + "-" + x.name;
      auto write = x.write;
      write.insert(write.end(), {"--checkpoint-dir", ck});
      launched(2, model, 3, dir.path, "write", write);
      REQUIRE(std::filesystem::exists(ck + "/config.json"));
      auto one = single_and_twin(model, 1, dir.path, {"--model-hf", ck});
      auto read = x.read;
      read.insert(read.end(), {"--model-hf", ck});
      same_losses(launched(2, model, 1, dir.path, "read", read), one);
    }
  }
}

TEST_CASE("A rank killed in the middle of a run stops the job with an error naming it",
          "[multirank][slow]") {
  std::vector<std::string> a = {troupe_bin, "launch",  "-n",
                                "4",        "--job",   "hybrid-kill-" + std::to_string(::getpid()),
                                "--",       troupe_bin};
  auto flags = run_flags("gpt2-demo", 100000);
  auto every = std::find(flags.begin(), flags.end(), "--log-every");
  REQUIRE(every != flags.end());
  *(every + 1) = "1";
  a.insert(a.end(), flags.begin(), flags.end());
  for (const char* f : {"--dp", "2", "--pp", "2", "--microbatches", "2"}) a.push_back(f);
  child_process p(a);
  REQUIRE(p.wait_for("step     3/", 120s));
  // "troupe coordinator: rank 3 (host vm, pid 1234) joined (...)"
  auto joined = p.lines_with("rank 3 (host");
  REQUIRE(!joined.empty());
  auto at = joined.front().find("pid ");
  REQUIRE(at != std::string::npos);
  const pid_t victim = std::stoi(joined.front().substr(at + 4));
  REQUIRE(::kill(victim, SIGKILL) == 0);
  auto st = p.wait(60s);
  INFO(p.output());
  REQUIRE(st.has_value());  // the job ends by itself: nobody waits forever on the dead rank
  CHECK(child_process::code(*st) != 0);
  CHECK(!p.lines_with("rank 3").empty());
  bool named = false;
  for (const auto& l : p.lines_with("rank 3"))
    named = named || l.find("lost") != std::string::npos || l.find("killed") != std::string::npos;
  CHECK(named);
}

TEST_CASE("Training with memory tiers matches the plain run in one process and launched",
          "[multirank]") {
  auto dir = scratch("tiers");
  const int steps = 4;
  auto want = single_and_twin("gpt2-demo", steps, dir);
  // Every chunk offloaded, parameters and optimizer state paged through NVMe.
  const std::vector<std::string> tiers = {
      "--device-memory",  "24M", "--host-memory",       "8M", "--nvme-dir", dir + "/nvme",
      "--offload-params", "1",   "--offload-optimizer", "1"};
  auto got = single("gpt2-demo", steps, dir, tiers);
  // Bitwise: in one process the tiers only move the bytes between memories; the same kernels run
  // in the same order on the same values.
  REQUIRE(got.size() == want.f32.size());
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == want.f32[i]);
  // Launched, the trainer runs in the tier-manager actor and pages through its NVMe actor; then
  // the automatic placement.
  same_losses(launched(1, "gpt2-demo", steps, dir, "tiers", tiers), want);
  same_losses(
      launched(1, "gpt2-demo", steps, dir, "tiers",
               {"--device-memory", "24M", "--offload", "auto", "--nvme-dir", dir + "/nvme"}),
      want);
  std::filesystem::remove_all(dir);
}

// A Llama under memory tiers, every chunk on the host and each block recomputed: the same losses
// bit for bit as its plain run without recompute (paging moves bytes; recompute repeats the same
// arithmetic).
TEST_CASE("A Llama trains with memory tiers and recompute as its plain run does", "[multirank]") {
  auto dir = scratch("tiers-llama");
  const int steps = 4;
  const auto want = single("llama-tiny", steps, dir);
  const auto got = single("llama-tiny", steps, dir,
                          {"--device-memory", "24M", "--offload-params", "1", "--offload-optimizer",
                           "1", "--recompute"},
                          "tiers");
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == want[i]);
  std::filesystem::remove_all(dir);
}

// A budget that cannot hold a step, found while the tier-manager actor sets up (after it spawned
// its NVMe actor): the run ends at once with the error naming the flag, not in a hang at shutdown.
TEST_CASE("A launched run with memory tiers too small for a step fails naming the budget",
          "[multirank]") {
  auto dir = scratch("tiers-small");
  std::vector<std::string> a = {troupe_bin, "launch", "-n", "1", "--", troupe_bin};
  auto flags = run_flags("gpt2-demo", 2);
  a.insert(a.end(), flags.begin(), flags.end());
  for (const std::string f : {"--device-memory", "64K", "--nvme-dir", "", "--offload-params", "1"})
    a.push_back(f.empty() ? dir + "/nvme" : f);
  child_process p(a);
  auto st = p.wait(60s);
  INFO(p.output());
  REQUIRE(st.has_value());
  CHECK(child_process::code(*st) != 0);
  CHECK(!p.lines_with("--device-memory").empty());
  std::filesystem::remove_all(dir);
}

TEST_CASE("troupe ps shows the tiers of a job training with them", "[multirank]") {
  const std::string job = "tiers-ps-" + std::to_string(::getpid());
  std::vector<std::string> a = {troupe_bin, "launch", "-n", "1", "--job", job, "--", troupe_bin};
  auto flags = run_flags("gpt2-demo", 100000);
  *(std::find(flags.begin(), flags.end(), "--log-every") + 1) = "1";
  a.insert(a.end(), flags.begin(), flags.end());
  for (const char* f : {"--device-memory", "24M", "--offload-params", "1"}) a.push_back(f);
  child_process p(a);
  REQUIRE(p.wait_for("step     2/", 120s));
  child_process ps({troupe_bin, "ps", "--job", job, "--json"});
  auto st = ps.wait(60s);
  INFO(ps.output());
  REQUIRE(st.has_value());
  CHECK(child_process::code(*st) == 0);
  CHECK(!ps.lines_with("tier-manager").empty());
  CHECK(!ps.lines_with("tier.device_bytes").empty());
  CHECK(!ps.lines_with("tier.prefetch_hit_rate").empty());
  p.signal(SIGTERM);
  CHECK(p.wait(60s).has_value());
}
