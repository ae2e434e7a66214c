// troupe ppo through the binary as a user runs it: from an HF folder (the tiny Llama given the
// addition format by a short SFT, tests/multirank/rl_command.hpp), the mean reward of the --json
// lines rises over a short run with a fixed seed and does not without learning (the control);
// under troupe launch -n 2 (the rollout actor on rank 1) its steps are the single process's; the
// policy's checkpoint is an HF folder that troupe generate reads and the critic's a reward-model
// folder that troupe ppo --critic reads back; the job file's [ppo] section is read and the flags
// override it; bad input (a bad job key or value, a critic folder without a score head, an
// unknown flag) is refused naming the file and key, the folder or the flag. Each refusal prints
// its "faults:" line.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/multirank/rl_command.hpp"
#include "tests/multirank/train_runs.hpp"

using namespace troupe;
using namespace troupe::tests;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

double mean_of(const std::vector<nlohmann::json>& steps, std::size_t from, std::size_t n) {
  double s = 0;
  for (std::size_t i = from; i < from + n; ++i) s += steps[i]["mean_reward"].get<double>();
  return s / static_cast<double>(n);
}

// The addition job of these tests: troupe_example_ppo's settings (2 epochs, policy and critic
// learning rates 1e-3, KL 0.05, 16 prompts x 8 samples) on the SFT'd folder, one thread.
std::vector<std::string> addition_job(const std::string& sft, const std::string& lr,
                                      const std::string& steps) {
  return {"ppo",
          sft.empty() ? "--steps" : "--model",
          sft.empty() ? steps : sft,
          "--task",
          "addition",
          "--max-new-tokens",
          "3",
          "--lr",
          lr,
          "--critic-lr",
          lr,
          "--seed",
          "1",
          "--threads",
          "1",
          "--steps",
          steps};
}

const std::string examples = std::string(TROUPE_SOURCE_DIR) + "/examples/post/";

}  // namespace

TEST_CASE("troupe ppo raises the mean reward and saves checkpoints troupe generate reads",
          "[multirank]") {
  scratch_dir dir("ppo-cmd");
  const std::string sft = dir.path + "/sft", ck = dir.path + "/ppo", json = dir.path + "/p.json";
  addition_sft(sft);
  auto args = addition_job(sft, "1e-3", "20");
  args.insert(args.end(), {"--checkpoint-dir", ck, "--checkpoint-every", "10", "--json", json});
  const auto r = run_troupe(args);
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Contains("task addition: 100 prompts") &&
                           Contains("16 prompts x 8 samples per step, 2 epochs") &&
                           Contains("step   20/20  mean reward") && Contains("policy loss") &&
                           Contains("value loss") && Contains("generating") &&
                           Contains("training") && Contains("syncing"));
  // Saved at step 10 and again at 20 (versions count optimizer steps: 2 epochs a step), the
  // policy replacing its folder; the critic beside it.
  CHECK_THAT(r.output, Contains("policy: checkpoint: step 20 saved in") &&
                           Contains("policy: checkpoint: step 40 saved in") &&
                           Contains("(it held step 20 before)") &&
                           Contains("critic: checkpoint: step 40 saved in '" + ck + "-critic'"));
  const auto steps = json_lines(json);
  REQUIRE(steps.size() == 20);
  for (const char* key :
       {"mean_reward", "kl", "policy_loss", "clipfrac", "value_loss", "value_clipfrac",
        "generate_seconds", "train_seconds", "sync_seconds", "weights_version"})
    CHECK(steps.back().contains(key));
  for (const auto& s : steps)  // sync: batch k sampled by the weights after k - 1 updates
    CHECK(s["weights_version"].get<int>() == 2 * (s["step"].get<int>() - 1));
  // Steps 1-5 against 16-20, the PPO example's test's measure and margin (0.15: about 5 standard
  // deviations of the difference of two means of 5 steps that the prompts' draw alone gives).
  // Measured here: 0.469 -> 0.691; the control below: 0.445 -> 0.453.
  const double first = mean_of(steps, 0, 5), last = mean_of(steps, 15, 5);
  std::printf("troupe ppo: mean reward of steps 1-5 %.3f, 16-20 %.3f\n", first, last);
  CHECK(last > first + 0.15);

  // The control: the same job with learning rates of 1e-12 (no learning: the weights stay the
  // SFT's) draws the same prompts; its reward must not pass the check above, so the check
  // measures learning, not the draw.
  const auto c = run_troupe([&] {
    auto a = addition_job(sft, "1e-12", "20");
    a.insert(a.end(), {"--json", json + ".control"});
    return a;
  }());
  INFO(c.output);
  REQUIRE(c.code == 0);
  const auto control = json_lines(json + ".control");
  REQUIRE(control.size() == 20);
  const double c_first = mean_of(control, 0, 5), c_last = mean_of(control, 15, 5);
  std::printf("troupe ppo, no learning: mean reward of steps 1-5 %.3f, 16-20 %.3f\n", c_first,
              c_last);
  CHECK_FALSE(c_last > c_first + 0.15);
  CHECK(control[0]["mean_reward"] == steps[0]["mean_reward"]);  // the same first batch

  // The same job launched on 2 ranks, its rollout actor on rank 1 (the weights reach it as tensor
  // messages between processes): the same samples, so the same numbers, bit for bit (the same
  // kernels in the same order on one thread; JSON writes doubles round-trip exactly).
  std::vector<std::string> launch{
      "launch", "-n", "2", "--job", "ppo-cmd-" + std::to_string(::getpid()), "--", troupe_bin};
  auto job = addition_job(sft, "1e-3", "6");
  launch.insert(launch.end(), job.begin(), job.end());
  launch.insert(launch.end(), {"--json", json + ".2"});
  const auto l = run_troupe(launch);
  INFO(l.output);
  REQUIRE(l.code == 0);
  CHECK_THAT(l.output, Contains("1 rollout actor(s) on rank(s) 1, sync"));
  const auto launched = json_lines(json + ".2");
  REQUIRE(launched.size() == 6);
  for (std::size_t i = 0; i < launched.size(); ++i)
    for (const char* key : {"mean_reward", "kl", "policy_loss", "clipfrac", "value_loss",
                            "grad_norm", "critic_grad_norm", "new_tokens"})
      CHECK(launched[i][key] == steps[i][key]);

  // The policy's checkpoint: an HF folder of the last step that troupe generate loads.
  REQUIRE(fs::exists(ck + "/model.safetensors"));
  REQUIRE(fs::exists(ck + "/config.json"));
  const auto g =
      run_troupe({"generate", "--model", ck, "--prompt", "3+5=", "--max-new", "3", "--greedy"});
  INFO(g.output);
  CHECK(g.code == 0);
  CHECK_THAT(g.output, Contains("3+5="));
  // The critic's: a reward-model folder (score.weight) that a next run's critic starts from.
  REQUIRE(fs::exists(ck + "-critic/model.safetensors"));
  std::ifstream config(ck + "-critic/config.json");
  const auto cfg = nlohmann::json::parse(config);
  CHECK(cfg["architectures"][0].get<std::string>().find("ForSequenceClassification") !=
        std::string::npos);
  auto again = addition_job(ck, "1e-3", "1");
  again.insert(again.end(), {"--critic", ck + "-critic"});
  const auto a = run_troupe(again);
  INFO(a.output);
  CHECK(a.code == 0);
  CHECK_THAT(a.output, Contains("critic " + ck + "-critic"));
}

TEST_CASE("troupe ppo reads its job file and the flags given override it", "[multirank]") {
  scratch_dir dir("ppo-job");
  const std::string ck = dir.path + "/ck";
  // The file starts from /tmp/troupe-sft (absent here) with 20 steps of 8 prompts; the flags
  // start from a named size instead, with 2 steps of 4 prompts and another folder.
  const auto r =
      run_troupe({"ppo", "--config", examples + "ppo.toml", "--model", "llama-tiny", "--prompts",
                  examples + "prompts.jsonl", "--steps", "2", "--prompts-per-step", "4",
                  "--samples-per-prompt", "2", "--checkpoint-dir", ck});
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Contains("troupe ppo: llama-tiny, tokenizer byte, template chatml") &&
                           Contains("task prompts: 32 prompts from") &&
                           Contains("4 prompts x 2 samples per step, 2 epochs, kl 0.05 x k3") &&
                           Contains("step    2/2  mean reward"));
  CHECK(fs::exists(ck + "/model.safetensors"));
  CHECK(fs::exists(ck + "-critic/model.safetensors"));
}

TEST_CASE(
    "troupe ppo refuses a bad job key, a bad value, a critic without a score head and an "
    "unknown flag by name",
    "[multirank][faults]") {
  scratch_dir dir("ppo-keys");
  const std::string train_key = dir.path + "/train.toml", est = dir.path + "/est.toml";
  std::ofstream(train_key) << "[train]\nbatch = 4\n";
  std::ofstream(est) << "[ppo]\nkl_estimator = \"k2\"\n";
  const auto t = run_troupe({"ppo", "--config", train_key});
  CHECK(t.code != 0);
  CHECK_THAT(t.output, Contains(train_key + ": 'train.batch' is a key of troupe train's job files "
                                            "that troupe ppo does not read"));
  std::printf("faults: troupe ppo with train.batch in its job file -> refused: %s",
              t.output.substr(t.output.find(train_key)).c_str());
  const auto e = run_troupe({"ppo", "--config", est});
  CHECK(e.code != 0);
  CHECK_THAT(e.output,
             Contains(est + ": ppo.kl_estimator (--kl-estimator) must be \"k1\" or \"k3\""));
  std::printf("faults: troupe ppo with ppo.kl_estimator = k2 -> refused: %s",
              e.output.substr(e.output.find(est)).c_str());
  // A causal LM's folder has no score.weight: --critic wants a reward model's.
  const std::string lm = dir.path + "/lm";
  addition_sft(lm);
  const auto c = run_troupe({"ppo", "--model", lm, "--max-new-tokens", "3", "--steps", "1",
                             "--critic", lm, "--threads", "1"});
  CHECK(c.code != 0);
  CHECK_THAT(c.output, Contains("score.weight"));
  std::printf("faults: troupe ppo --critic with a causal LM's folder -> refused: %s",
              c.output.substr(c.output.find("troupe: error")).c_str());
  const auto f = run_troupe({"ppo", "--group", "4"});
  CHECK(f.code != 0);
  CHECK_THAT(f.output, Contains("unknown flag '--group'"));
  std::printf("faults: troupe ppo --group -> refused: %s",
              f.output.substr(f.output.find("troupe:")).c_str());
}
