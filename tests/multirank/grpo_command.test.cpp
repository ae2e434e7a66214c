// troupe grpo through the binary as a user runs it: from an HF folder (a tiny Llama given the
// addition format by a short SFT here, as apps/examples/grpo.cpp does), the mean reward of the
// --json lines rises over a short run with a fixed seed, under troupe launch -n 2 (the rollout
// actor on rank 1) its steps are the single process's, the checkpoint is an HF folder that troupe
// generate reads, the job file's [grpo] section is read and the flags override it, and bad input
// (a malformed prompts line, a prompt longer than the sequence, a missing answer, a bad job key,
// an unknown flag) is refused naming the file and line or the key. Each refusal prints its
// "faults:" line.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "tests/multirank/rl_command.hpp"
#include "tests/multirank/train_runs.hpp"

using namespace troupe;
using namespace troupe::tests;
using Catch::Contains;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

double mean_of(const std::vector<nlohmann::json>& steps, std::size_t from, std::size_t n) {
  double s = 0;
  for (std::size_t i = from; i < from + n; ++i) s += steps[i]["mean_reward"].get<double>();
  return s / static_cast<double>(n);
}

const std::string examples = std::string(TROUPE_SOURCE_DIR) + "/examples/post/";

}  // namespace

TEST_CASE("troupe grpo raises the mean reward and saves a checkpoint troupe generate reads",
          "[multirank]") {
  scratch_dir dir("grpo-cmd");
  const std::string sft = dir.path + "/sft", ck = dir.path + "/grpo", json = dir.path + "/g.json";
  addition_sft(sft);
  const auto r = run_troupe({"grpo",     "--model",
                             sft,        "--task",
                             "addition", "--steps",
                             "40",       "--max-new-tokens",
                             "3",        "--lr",
                             "1e-3",     "--seed",
                             "1",        "--threads",
                             "1",        "--checkpoint-dir",
                             ck,         "--checkpoint-every",
                             "20",       "--json",
                             json});
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Contains("task addition: 100 prompts") &&
                           Contains("16 prompts x 8 samples per step") &&
                           Contains("step   40/40  mean reward") && Contains("generating") &&
                           Contains("training") && Contains("syncing"));
  // Saved at step 20 and again at 40, replacing it.
  CHECK_THAT(r.output, Contains("step 20 saved in") && Contains("step 40 saved in") &&
                           Contains("(it held step 20 before)"));
  const auto steps = json_lines(json);
  REQUIRE(steps.size() == 40);
  for (const char* key : {"mean_reward", "kl", "loss", "generate_seconds", "train_seconds",
                          "sync_seconds", "weights_version"})
    CHECK(steps.back().contains(key));
  for (const auto& s : steps)  // sync: the batch of step k is sampled by the weights of k - 1
    CHECK(s["weights_version"].get<int>() == s["step"].get<int>() - 1);
  // Steps 1-5 against 36-40. Measured here: 0.464 -> 0.733. The same run with --lr 1e-12 (no
  // learning; the same prompts and samples until the weights differ) gave 0.445 -> 0.445: the
  // per-step mean reward then varies with the prompts drawn (standard deviation 0.055 over its 40
  // steps), so a difference of two means of 5 has a deviation of ~0.035. A margin of 0.15 is ~4
  // of those and 56% of the rise seen: the check fails without learning and passes with it.
  const double first = mean_of(steps, 0, 5), last = mean_of(steps, 35, 5);
  std::printf("troupe grpo: mean reward of steps 1-5 %.3f, 36-40 %.3f\n", first, last);
  CHECK(last > first + 0.15);

  // The same job launched on 2 ranks, its rollout actor on rank 1 (the weights reach it as tensor
  // messages between processes): the same samples, so the same numbers, bit for bit (the same
  // kernels in the same order on one thread; JSON writes doubles round-trip exactly).
  std::vector<std::string> args{
      "launch", "-n", "2", "--job", "grpo-cmd-" + std::to_string(::getpid()), "--", troupe_bin};
  args.insert(args.end(), {"grpo", "--model", sft, "--task", "addition", "--max-new-tokens", "3",
                           "--lr", "1e-3", "--seed", "1", "--threads", "1"});
  args.insert(args.end(), {"--steps", "8", "--json", json + ".2"});
  const auto l = run_troupe(args);
  INFO(l.output);
  REQUIRE(l.code == 0);
  CHECK_THAT(l.output, Contains("1 rollout actor(s) on rank(s) 1, sync"));
  const auto launched = json_lines(json + ".2");
  REQUIRE(launched.size() == 8);
  for (std::size_t i = 0; i < launched.size(); ++i)
    for (const char* key : {"mean_reward", "loss", "kl", "grad_norm", "new_tokens"})
      CHECK(launched[i][key] == steps[i][key]);

  // The checkpoint: an HF folder of the 40th step that troupe generate loads and continues from.
  REQUIRE(fs::exists(ck + "/model.safetensors"));
  REQUIRE(fs::exists(ck + "/config.json"));
  const auto g =
      run_troupe({"generate", "--model", ck, "--prompt", "3+5=", "--max-new", "3", "--greedy"});
  INFO(g.output);
  CHECK(g.code == 0);
  CHECK_THAT(g.output, Contains("3+5="));
}

TEST_CASE("troupe grpo reads its job file and the flags given override it", "[multirank]") {
  scratch_dir dir("grpo-job");
  const std::string ck = dir.path + "/ck";
  // The file starts from /tmp/troupe-sft (absent here) with 20 steps of 8 prompts; the flags
  // start from a named size instead, with 2 steps of 4 prompts and another folder.
  const auto r = run_troupe({"grpo", "--config", examples + "grpo.toml", "--model", "llama-tiny",
                             "--prompts", examples + "prompts.jsonl", "--steps", "2",
                             "--prompts-per-step", "4", "--group", "2", "--checkpoint-dir", ck});
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Contains("troupe grpo: llama-tiny, tokenizer byte, template chatml") &&
                           Contains("task prompts: 32 prompts from") &&
                           Contains("4 prompts x 2 samples per step") &&
                           Contains("step    2/2  mean reward"));
  CHECK(fs::exists(ck + "/model.safetensors"));
}

TEST_CASE("troupe grpo refuses bad prompts naming the file and line", "[multirank][faults]") {
  scratch_dir dir("grpo-bad");
  const std::string bad = dir.path + "/bad.jsonl", lng = dir.path + "/long.jsonl",
                    noans = dir.path + "/noanswer.jsonl";
  std::ofstream(bad) << R"({"prompt": "1+1=", "answer": "2"})"
                     << "\n"
                     << R"({"prompt": "2+2=", "answer": )"
                     << "\n";
  std::ofstream(lng) << R"({"prompt": ")" << std::string(1000, 'x') << R"(", "answer": "x"})"
                     << "\n";
  std::ofstream(noans) << R"({"prompt": "2+2="})"
                       << "\n";
  const auto b = run_troupe({"grpo", "--prompts", bad, "--steps", "1"});
  CHECK(b.code != 0);
  CHECK_THAT(b.output, Contains(bad + ":2: "));
  std::printf("faults: troupe grpo with a malformed prompts line -> refused: %s",
              b.output.substr(b.output.find(bad)).c_str());
  // llama-tiny holds 256 positions: with the 8 new tokens of the default, prompts of up to 248.
  const auto l = run_troupe({"grpo", "--prompts", lng, "--steps", "1"});
  CHECK(l.code != 0);
  CHECK_THAT(l.output, Contains(lng + ":1: the prompt is 1000 tokens, longer than the 248"));
  std::printf("faults: troupe grpo with a prompt longer than the sequence -> refused: %s",
              l.output.substr(l.output.find(lng)).c_str());
  const auto n = run_troupe({"grpo", "--prompts", noans, "--steps", "1"});
  CHECK(n.code != 0);
  CHECK_THAT(n.output, Contains(noans + ":1: the line has no \"answer\""));
  std::printf("faults: troupe grpo with a prompt missing its answer -> refused: %s",
              n.output.substr(n.output.find(noans)).c_str());
}

TEST_CASE("troupe grpo refuses a bad job key, a bad value and an unknown flag by name",
          "[multirank][faults]") {
  scratch_dir dir("grpo-keys");
  const std::string train_key = dir.path + "/train.toml", group = dir.path + "/group.toml";
  std::ofstream(train_key) << "[train]\nbatch = 4\n";
  std::ofstream(group) << "[grpo]\ngroup = 1\n";
  const auto t = run_troupe({"grpo", "--config", train_key});
  CHECK(t.code != 0);
  CHECK_THAT(t.output, Contains(train_key + ": 'train.batch' is a key of troupe train's job files "
                                            "that troupe grpo does not read"));
  std::printf("faults: troupe grpo with train.batch in its job file -> refused: %s",
              t.output.substr(t.output.find(train_key)).c_str());
  const auto g = run_troupe({"grpo", "--config", group});
  CHECK(g.code != 0);
  CHECK_THAT(g.output, Contains(group + ": grpo.group (--group) must be > 1"));
  std::printf("faults: troupe grpo with grpo.group = 1 -> refused: %s",
              g.output.substr(g.output.find(group)).c_str());
  const auto f = run_troupe({"grpo", "--group-size", "4"});
  CHECK(f.code != 0);
  CHECK_THAT(f.output, Contains("unknown flag '--group-size'"));
  std::printf("faults: troupe grpo --group-size -> refused: %s",
              f.output.substr(f.output.find("troupe:")).c_str());
}
