// troupe ppo's job file (ppo_job.hpp): the sections and keys it reads, the defaults, and the
// errors naming the file and "section.key" (with the flag) for unknown keys, wrong types and bad
// values; read by the machinery troupe grpo's job file shares (rl_job_file.hpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <string>

#include "models/post/ppo_job.hpp"

using namespace troupe::models;
using Catch::Contains;

TEST_CASE("a ppo job file sets every section's keys over the defaults", "[cpu]") {
  auto j = parse_ppo_job(R"(
[model]
size = "llama-small"
[ppo]
task = "prompts"
prompts_file = "q.jsonl"
reward = "partial"
template = "llama3"
steps = 7
prompts_per_step = 6
samples_per_prompt = 1
max_new_tokens = 12
temperature = 0.7
top_p = 0.9
seed = 5
rollouts = 2
staleness = 1
log_every = 3
epochs = 4
kl_coef = 0
kl_estimator = "k3"
whiten_rewards = true
gamma = 0.99
lam = 0.9
cliprange = 0.1
cliprange_value = 0.3
vf_coef = 0.5
[critic]
hf = "/ck/rm"
lr = 3e-5
[optim]
lr = 2e-5
warmup = 4
weight_decay = 0.01
clip = 0.5
[checkpoint]
dir = "/ck/ppo"
critic_dir = "/ck/value"
every = 5
[parallel]
dp = 2
pp = 2
microbatches = 2
)",
                         "job.toml");
  REQUIRE(j.has_value());
  ppo_job want;
  want.model_size = "llama-small";
  want.task = "prompts";
  want.prompts_file = "q.jsonl";
  want.reward = "partial";
  want.chat_template = "llama3";
  want.steps = 7;
  want.prompts_per_step = 6;
  want.group = 1;
  want.max_new_tokens = 12;
  want.temperature = 0.7;
  want.top_p = 0.9;
  want.seed = 5;
  want.rollouts = 2;
  want.staleness = 1;
  want.log_every = 3;
  want.epochs = 4;
  want.kl_coef = 0;
  want.kl_estimator = "k3";
  want.whiten_rewards = true;
  want.gamma = 0.99;
  want.lam = 0.9;
  want.cliprange = 0.1;
  want.cliprange_value = 0.3;
  want.vf_coef = 0.5;
  want.critic_hf = "/ck/rm";
  want.critic_lr = 3e-5;
  want.lr = 2e-5;
  want.warmup = 4;
  want.weight_decay = 0.01;
  want.clip = 0.5;
  want.ckpt_dir = "/ck/ppo";
  want.critic_ckpt_dir = "/ck/value";
  want.ckpt_every = 5;
  want.dp = want.pp = want.microbatches = 2;
  CHECK(*j == want);
  CHECK(j->critic_dir() == "/ck/value");
  CHECK(parse_ppo_job("", "empty.toml").value() == ppo_job{});
  CHECK_NOTHROW(ppo_job{}.validate());
  // Without checkpoint.critic_dir the critic goes beside the policy.
  CHECK(parse_ppo_job("[checkpoint]\ndir = \"/ck/p\"\n", "job.toml")->critic_dir() ==
        "/ck/p-critic");
  CHECK(ppo_job{}.critic_dir().empty());
}

TEST_CASE("a ppo job file's bad keys and values are refused naming the file and key",
          "[cpu][faults]") {
  const auto refused = [](const std::string& text) {
    const auto j = parse_ppo_job(text, "job.toml");
    REQUIRE_FALSE(j.has_value());
    std::string one_line = text;  // the "faults:" line is one line
    std::replace(one_line.begin(), one_line.end(), '\n', ' ');
    std::printf("faults: ppo job '%s' -> refused: %s\n", one_line.c_str(),
                j.error_message().c_str());
    return j.error_message();
  };
  CHECK_THAT(refused("[ppo]\ngroup = 4\n"),
             Contains("job.toml: unknown key 'ppo.group' (troupe ppo reads [model], [ppo], "
                      "[critic], [optim], [checkpoint], [parallel])"));
  CHECK_THAT(refused("[grpo]\nsteps = 4\n"), Contains("job.toml: unknown key 'grpo.steps'"));
  CHECK_THAT(refused("[train]\nbatch = 4\n"),
             Contains("job.toml: 'train.batch' is a key of troupe train's job files that troupe "
                      "ppo does not read (its rows are ppo.prompts_per_step x "
                      "ppo.samples_per_prompt"));
  CHECK_THAT(refused("[ppo]\nepochs = 1.5\n"), Contains("job.toml: ppo.epochs must be an integer"));
  CHECK_THAT(refused("[ppo]\nwhiten_rewards = 1\n"),
             Contains("ppo.whiten_rewards must be true or false"));
  CHECK_THAT(refused("[ppo]\nepochs = 0\n"), Contains("ppo.epochs (--epochs) must be > 0"));
  CHECK_THAT(refused("[ppo]\nsamples_per_prompt = 0\n"),
             Contains("ppo.samples_per_prompt (--samples-per-prompt) must be > 0"));
  CHECK_THAT(refused("[ppo]\nkl_estimator = \"k2\"\n"),
             Contains("ppo.kl_estimator (--kl-estimator) must be \"k1\" or \"k3\", got 'k2'"));
  CHECK_THAT(refused("[ppo]\ngamma = 0\n"), Contains("ppo.gamma (--gamma) must be in (0, 1]"));
  CHECK_THAT(refused("[ppo]\nlam = 1.5\n"), Contains("ppo.lam (--lam) must be in [0, 1]"));
  CHECK_THAT(refused("[ppo]\ncliprange = 1\n"), Contains("ppo.cliprange (--cliprange)"));
  CHECK_THAT(refused("[critic]\nlr = -1\n"), Contains("critic.lr (--critic-lr) must be > 0"));
  CHECK_THAT(refused("[checkpoint]\ncritic_dir = \"/v\"\n"),
             Contains("checkpoint.critic_dir (--critic-checkpoint-dir) needs checkpoint.dir"));
  CHECK_THAT(refused("[checkpoint]\ndir = \"/p\"\ncritic_dir = \"/p\"\n"),
             Contains("must differ from checkpoint.dir"));
  CHECK_THAT(refused("[ppo]\ntask = \"prompts\"\n"),
             Contains("ppo.prompts_file (--prompts) is needed by ppo.task = \"prompts\""));
  CHECK_THAT(refused("[ppo]\nrollouts = 3\n"), Contains("must be a multiple of ppo.rollouts (3)"));
  CHECK_THAT(refused("[ppo]\nsteps = \n"), Contains("job.toml:2:"));
  CHECK_THAT(refused("ppo = 3\n"), Contains("'ppo' must be a [section]"));
}
