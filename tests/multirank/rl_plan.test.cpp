// The RL loops with their policy trainer under a parallel plan (`troupe launch -n N -- troupe grpo
// --dp 2 --pp 2 ...`, the same for troupe ppo): the policy is a grid of rl_plan_trainer actors on
// ranks 0..G-1 (actors/rl_plan_trainer.hpp), each stepping its piece on the step's whole batch,
// the rollout actor on the rank after them (or sharing rank 0), and the gathered policy goes to it
// after every update; PPO's critic stays a whole model on rank 0. The per-step numbers (--json:
// mean reward, new tokens; GRPO's loss, KL, gradient norm; PPO's policy loss, approx KL, norms, KL
// to the reference, value loss) and the final policy weights are the single-process command's for
// the same seed.
//
// Same samples. The rollout actors sample from the pushed policy, which differs from the single
// process's by f32 rounding (the plan sums in another order), so a sampled token flips only when
// its uniform draw falls within the two policies' probability difference of a boundary of the
// sampling distribution (relative 1e-6 to 1e-4 here, from the weights' differences below): with
// ~80 sampled tokens per step, about 1e-4 to 1e-2 per step. The test finds the first step whose
// samples differ (mean reward or new tokens not equal: the reward is a pure function of the
// samples) and compares every step before it; it requires all steps to have the same samples
// (they do here, deterministically: the same kernels on one thread each run), so a flip fails
// loudly, naming the step, rather than passing a shorter comparison.
//
// Tolerances (troupe grpo and ppo have no f64 twin: their rollout, reference, critic and trainer
// actors run f32 models). A plan's step is the single process's up to the summation order of its
// reductions (dp: the gradient halves summed across ranks; tp: the sharded matmuls' partial sums),
// and from step 2 on also up to the rounding its earlier updates carried into the weights.
// Measured here (TROUPE_PRINT_RATIOS prints them), relative to each value's magnitude (its |value|
// plus the run's mean |value|, for values crossing zero): GRPO dp2 x pp2 and dp2 ZeRO 2 up to
// 7e-7, dp2 async 9.2e-6, tp2 1.3e-5 (tp's partial sums change every matmul's rounding); PPO dp2 x
// pp2 up to 8e-7, tp2 2.2e-5; PPO's entropy (reduced over tp's vocabulary shards) 3.1e-8 under dp2
// x pp2 and 3.9e-7 under tp2. The checks allow 1e-3. The weights: AdamW normalises each update by
// its own gradient size, so an element whose gradient is near zero can move by up to lr either
// way from rounding alone (tests/multirank/same_weights.hpp) and an elementwise bound means
// nothing; the distance between the two runs' final weights relative to the distance the single
// process moved them, ||w_plan - w_one|| / ||w_one - w_0||, is measured at 2e-6 to 3e-6 (dp, pp),
// 3.4e-5 (GRPO tp2) and 9.6e-5 (PPO tp2) and allowed 1e-3.
//
// PPO runs 3 steps (6 optimizer steps: 2 epochs each). Over 6 steps its differences grew about
// 100-fold at step 4 in every plan alike (dp2 x pp2 from 1e-7 to 1e-5, tp2 from 1e-5 to 3e-3,
// with the same samples and clip fractions): the second epoch's large updates (lr 1e-3, approx KL
// ~0.01) amplify whatever rounding the plan brings, so the comparison stops before it.
//
// What a wrong plan gives: with the dp gradient allreduce removed (each replica trains on its half
// of the batch) GRPO's step-1 gradient norm is 0.92 against 1.17 (0.2 relative), PPO's policy
// loss, approx KL and norm differ by 0.09 to 0.8 of their scale at step 1, and the samples differ
// from step 2 on (seen failing both tests); one update fewer moves the weights by ~1/6 of the
// distance. With the entropy's sum allreduce over tp removed (each shard's own columns only), tp2's
// entropy is off by 2.5e-3 relative at one step (0.8518 vs 0.8539, seen failing): this model's
// mass lies on the digits, in shard 0's columns, so the check here is weak against that bug;
// models/parallel/vocab_entropy.test.cpp is the strong one (45 of 51 checks fail).
#include <fmt/core.h>
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "models/hf/safetensors.hpp"
#include "tests/multirank/elastic_runs.hpp"
#include "tests/multirank/rl_command.hpp"

using namespace troupe;
using namespace troupe::tests;
using Catch::Contains;

namespace {

constexpr int steps = 6;

std::vector<std::string> grpo_flags(const std::string& model, const std::string& dir,
                                    const std::string& name) {
  return {"grpo",
          "--model",
          model,
          "--task",
          "addition",
          "--steps",
          std::to_string(steps),
          "--prompts-per-step",
          "4",
          "--group",
          "8",
          "--max-new-tokens",
          "3",
          "--lr",
          "3e-3",
          "--seed",
          "1",
          "--threads",
          "1",
          "--json",
          dir + "/" + name + ".json",
          "--checkpoint-dir",
          dir + "/" + name};
}

std::vector<std::string> launched(int n, const std::string& name, std::vector<std::string> flags,
                                  const std::vector<std::string>& plan) {
  std::vector<std::string> a = {"launch",
                                "-n",
                                std::to_string(n),
                                "--job",
                                "rlplan-" + name + "-" + std::to_string(::getpid()),
                                "--",
                                troupe_bin};
  a.insert(a.end(), flags.begin(), flags.end());
  a.insert(a.end(), plan.begin(), plan.end());
  return a;
}

// Every tensor of a checkpoint's model.safetensors, in the file's order, as f64.
std::vector<double> weights(const std::string& dir) {
  auto f = models::hf::safetensors_file::open(dir + "/model.safetensors");
  REQUIRE(f.has_value());
  std::vector<double> out;
  for (const auto& e : f->tensors()) {
    REQUIRE(e.type == dtype::f32);
    const tensor t = e.view();
    for (std::int64_t i = 0; i < t.numel(); ++i) out.push_back(t.data_as<float>()[i]);
  }
  return out;
}

double distance(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(s);
}

const std::vector<std::string> grpo_keys = {"loss", "kl", "grad_norm"};

bool print_ratios() {
  return std::getenv("TROUPE_PRINT_RATIOS") != nullptr;
}

// The launched run `got` against the single process `one` (their --json lines: `keys` compared
// step by step), and their checkpoints against the starting weights `start`.
void same_run(const std::string& d, const std::string& got, const std::string& one,
              const std::string& start, const std::vector<std::string>& keys) {
  const auto g = json_lines(d + "/" + got + ".json"), o = json_lines(d + "/" + one + ".json");
  REQUIRE(!o.empty());
  REQUIRE(g.size() == o.size());
  std::size_t same = 0;  // steps before the first whose samples differ
  while (same < g.size() && g[same]["mean_reward"] == o[same]["mean_reward"] &&
         g[same]["new_tokens"] == o[same]["new_tokens"])
    ++same;
  INFO(got << ": the samples are the single process's up to step " << same);
  CHECK(same == g.size());
  std::string worst;  // each key's largest relative difference
  for (const auto& key : keys) {
    double mean = 0, largest = 0;  // the run's mean |value|: the scale of values crossing zero
    for (const auto& s : o) mean += std::abs(s[key].get<double>()) / static_cast<double>(o.size());
    for (std::size_t i = 0; i < same; ++i) {
      INFO(got << " step " << i + 1);
      CHECK(g[i]["weights_version"] == o[i]["weights_version"]);
      const double a = g[i][key].get<double>(), b = o[i][key].get<double>();
      const double scale = std::abs(b) + mean;
      INFO(key << ": " << a << " vs " << b);
      CHECK(std::abs(a - b) <= 1e-3 * scale);
      if (scale > 0) largest = std::max(largest, std::abs(a - b) / scale);
    }
    worst += fmt::format("{}{} {:.3g}", worst.empty() ? "" : ", ", key, largest);
  }
  if (same < g.size()) return;  // the weights are compared after the same samples only
  const auto w0 = weights(start), w1 = weights(d + "/" + one), wg = weights(d + "/" + got);
  const double moved = distance(w1, w0), apart = distance(wg, w1);
  INFO(got << ": ||w_plan - w_one|| = " << apart << ", ||w_one - w_0|| = " << moved);
  REQUIRE(moved > 0);
  CHECK(apart <= 1e-3 * moved);
  if (print_ratios())
    std::printf("%s: relative differences: %s; weights %.3g\n", got.c_str(), worst.c_str(),
                apart / moved);
}

}  // namespace

TEST_CASE("GRPO's trainer under dp2 x pp2, tp2 and dp2 ZeRO 2 gives the single process's steps",
          "[multirank][post]") {
  scratch_dir dir("rl-plan");
  const std::string& d = dir.path;
  const std::string sft = d + "/sft";
  addition_sft(sft);
  const auto one = run_troupe(grpo_flags(sft, d, "one"));
  INFO(one.output);
  REQUIRE(one.code == 0);
  struct plan_run {
    int n;
    std::string name, says;
    std::vector<std::string> plan;
  };
  const std::vector<plan_run> runs = {
      // 4 trainer ranks and the rollout actor on rank 4.
      {5,
       "dp2pp2",
       "1 rollout actor(s) on rank(s) 4, sync",
       {"--dp", "2", "--pp", "2", "--microbatches", "2"}},
      // 2 trainer ranks, the rollout actor on rank 2.
      {3, "tp2", "1 rollout actor(s) on rank(s) 2, sync", {"--tp", "2"}},
      // Every rank a trainer: the rollout actor shares rank 0 (with the driver).
      {2, "dp2zero2", "1 rollout actor(s) on rank(s) 0, sync", {"--dp", "2", "--zero", "2"}},
  };
  for (const auto& p : runs) {
    const auto r = run_troupe(launched(p.n, p.name, grpo_flags(sft, d, p.name), p.plan));
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK_THAT(r.output, Contains(p.says) && Contains("(rl_plan_trainer pieces)"));
    same_run(d, p.name, "one", sft, grpo_keys);
  }
}

TEST_CASE("Async GRPO (staleness 1) with its trainer under dp2 gives the single process's steps",
          "[multirank][post]") {
  scratch_dir dir("rl-plan-async");
  const std::string& d = dir.path;
  const std::string sft = d + "/sft";
  addition_sft(sft);
  auto flags = [&](const std::string& name) {
    auto f = grpo_flags(sft, d, name);
    f.insert(f.end(), {"--staleness", "1"});
    return f;
  };
  const auto one = run_troupe(flags("one"));
  INFO(one.output);
  REQUIRE(one.code == 0);
  const auto r = run_troupe(launched(3, "dp2", flags("dp2"), {"--dp", "2"}));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Contains("async (staleness 1)"));
  same_run(d, "dp2", "one", sft, grpo_keys);
  // Async: the batch of step k was sampled by the weights of step k - 2 (one behind).
  for (const auto& s : json_lines(d + "/dp2.json"))
    CHECK(s["weights_version"].get<int>() == std::max(0, s["step"].get<int>() - 2));
}

// PPO's policy under a plan; its critic (a whole value model) stays on rank 0. The policy's two
// epochs per batch are two steps of the pieces; the critic's values and returns come from the same
// samples, so its loss and norm are compared too, and so is the policy's entropy.
TEST_CASE("PPO's policy under dp2 x pp2 and tp2 gives the single process's steps and weights",
          "[multirank][post]") {
  scratch_dir dir("rl-plan-ppo");
  const std::string& d = dir.path;
  const std::string sft = d + "/sft";
  addition_sft(sft);
  auto flags = [&](const std::string& name) {
    return std::vector<std::string>{"ppo",
                                    "--model",
                                    sft,
                                    "--task",
                                    "addition",
                                    "--steps",
                                    "3",
                                    "--prompts-per-step",
                                    "4",
                                    "--samples-per-prompt",
                                    "8",
                                    "--max-new-tokens",
                                    "3",
                                    "--lr",
                                    "1e-3",
                                    "--critic-lr",
                                    "1e-3",
                                    "--seed",
                                    "1",
                                    "--threads",
                                    "1",
                                    "--json",
                                    d + "/" + name + ".json",
                                    "--checkpoint-dir",
                                    d + "/" + name};
  };
  const auto one = run_troupe(flags("one"));
  INFO(one.output);
  REQUIRE(one.code == 0);
  // entropy: each position's reduced over the vocab-parallel head's shards under tp2
  // (models/parallel/vocab_entropy.hpp), from the whole logits of the last stage under pp2.
  const std::vector<std::string> keys = {"policy_loss", "approx_kl",        "grad_norm", "kl",
                                         "value_loss",  "critic_grad_norm", "entropy"};
  for (const auto& [n, name, plan] :
       {std::tuple{5, std::string("dp2pp2"),
                   std::vector<std::string>{"--dp", "2", "--pp", "2", "--microbatches", "2"}},
        std::tuple{3, std::string("tp2"), std::vector<std::string>{"--tp", "2"}}}) {
    const auto r = run_troupe(launched(n, "ppo-" + name, flags(name), plan));
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK_THAT(r.output, Contains("(rl_plan_trainer pieces); critic on rank 0"));
    same_run(d, name, "one", sft, keys);
  }
}

TEST_CASE("troupe grpo and ppo refuse a plan without launch, a grid beyond the ranks, cp and ep",
          "[multirank][post][faults]") {
  scratch_dir dir("rl-plan-refuse");
  const std::string& d = dir.path;
  auto refused = [](const run_result& r, const std::string& what, const std::string& text) {
    INFO(r.output);
    CHECK(r.code != 0);
    const auto at = r.output.find(text);
    REQUIRE(at != std::string::npos);
    const auto from = r.output.rfind('\n', at) + 1;  // npos + 1: the first line
    std::printf("faults: %s -> refused: %s\n", what.c_str(),
                r.output.substr(from, r.output.find('\n', at) - from).c_str());
  };
  auto flags = [&](const std::string& name, std::vector<std::string> extra) {
    auto f = grpo_flags("llama-tiny", d, name);
    f.insert(f.end(), extra.begin(), extra.end());
    return f;
  };
  refused(run_troupe(flags("alone", {"--dp", "2"})), "troupe grpo --dp 2 in one process",
          "start them with `troupe launch -n 2 -- troupe grpo");
  refused(run_troupe({"ppo", "--model", "llama-tiny", "--steps", "1", "--tp", "2"}),
          "troupe ppo --tp 2 in one process", "start them with `troupe launch -n 2 -- troupe ppo");
  refused(run_troupe(launched(2, "big", flags("big", {"--dp", "2", "--pp", "2"}), {})),
          "troupe grpo --dp 2 --pp 2 on 2 ranks",
          "= 4 trainer ranks but the job has 2 (troupe launch -n)");
  refused(run_troupe(launched(2, "cp", flags("cp", {"--cp", "2"}), {})), "troupe grpo --cp 2",
          "parallel.cp (--cp) 2: context parallelism is not supported for post-training yet");
  refused(run_troupe(launched(2, "ep", flags("ep", {"--ep", "2", "--dp", "2"}), {})),
          "troupe grpo --ep 2",
          "parallel.ep (--ep) 2: expert parallelism is not supported for post-training yet");
  const std::string elastic = d + "/elastic.toml", rows = d + "/rows.toml";
  std::ofstream(elastic) << "[elastic]\nenabled = true\n";
  refused(run_troupe(flags("elastic", {"--config", elastic})), "troupe grpo with [elastic]",
          "'elastic.enabled' is a key of troupe train's job files that troupe grpo does not read");
  // 4 prompts x 8 samples = 32 rows over dp 2 x 3 microbatches: refused before any rank joins.
  std::ofstream(rows) << "[parallel]\ndp = 2\nmicrobatches = 3\n";
  refused(run_troupe(launched(2, "rows", flags("rows", {"--config", rows}), {})),
          "troupe grpo with 32 rows over dp 2 x 3 microbatches",
          "32 rows per step do not split over parallel.dp (--dp) 2 x parallel.microbatches");
}

// A trainer rank lost mid-run (SIGKILL from outside, once the run has logged a few steps): its
// peers' collectives fail on the lost peer (UCX and the coordinator's membership see it), each
// piece's request fails, and the driver's ask of the grid ends the job with an error naming the
// rank, promptly (the 120 s bound is a hang detector, not a timing claim: it ends in about a
// second here). Both loops: GRPO's trainer under dp2 (its peer in the dp allreduce) and PPO's
// policy under dp2 x pp2 (a pipeline stage's peer waiting on its activations).
TEST_CASE("A trainer rank killed mid-run ends the GRPO or PPO job with an error naming it",
          "[multirank][post][faults]") {
  scratch_dir dir("rl-plan-kill");
  struct drill {
    const char* name;
    int n, victim;
    std::vector<std::string> flags;
  };
  const std::vector<drill> drills = {
      {"grpo-dp2", 3, 1, {"grpo", "--group", "4", "--dp", "2"}},
      {"ppo-dp2pp2",
       5,
       3,
       {"ppo", "--samples-per-prompt", "4", "--dp", "2", "--pp", "2", "--microbatches", "2"}},
  };
  for (const auto& d : drills) {
    SECTION(d.name) {
      auto flags = d.flags;
      // Far more steps than run before the kill: the job can only end by the failure.
      flags.insert(flags.end(), {"--model", "llama-tiny", "--task", "addition", "--steps", "100000",
                                 "--prompts-per-step", "2", "--max-new-tokens", "3", "--log-every",
                                 "1", "--threads", "1"});
      auto args = launched(d.n, std::string("kill-") + d.name, flags, {});
      args.insert(args.begin(), troupe_bin);
      child_process p(args, {{"TROUPE_NUM_THREADS", "1"}});
      REQUIRE(p.wait_for("step    3/", std::chrono::seconds(120)));
      const int pid = pid_of_rank(p, d.victim);
      REQUIRE(pid > 0);
      REQUIRE(::kill(pid, SIGKILL) == 0);
      const auto st = p.wait(std::chrono::seconds(120));
      INFO(p.output());
      REQUIRE(st.has_value());  // the job ends by itself: nobody waits forever on the lost rank
      CHECK(child_process::code(*st) != 0);
      // The driver's error (rank 0) names the lost trainer rank.
      const std::string lost = "rank " + std::to_string(d.victim) + " lost";
      std::string said;
      for (const auto& l : p.lines_with("[rank 0] troupe: error:"))
        if (l.find(lost) != std::string::npos) said = l;
      REQUIRE(!said.empty());
      std::printf("faults: SIGKILL of trainer rank %d of %s after step 3 -> refused: %s\n",
                  d.victim, d.name, said.substr(0, 300).c_str());
    }
  }
}
