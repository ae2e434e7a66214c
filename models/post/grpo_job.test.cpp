// troupe grpo's job file (grpo_job.hpp): the sections and keys it reads, the defaults, and the
// errors naming the file and "section.key" (with the flag) for unknown keys, wrong types and bad
// values.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <string>

#include "models/post/grpo_job.hpp"

using namespace troupe::models;
using Catch::Contains;

TEST_CASE("a grpo job file sets every section's keys over the defaults", "[cpu]") {
  auto j = parse_grpo_job(R"(
[model]
hf = "/ck/sft"
[grpo]
task = "prompts"
prompts_file = "q.jsonl"
reward = "partial"
template = "chatml"
steps = 7
prompts_per_step = 6
group = 4
max_new_tokens = 12
temperature = 0.7
top_p = 0.9
kl_coef = 0
clip_epsilon = 0.1
seed = 5
rollouts = 2
staleness = 1
log_every = 3
[optim]
lr = 2e-5
warmup = 4
weight_decay = 0.01
clip = 0.5
[checkpoint]
dir = "/ck/grpo"
every = 5
[parallel]
dp = 2
tp = 2
pp = 2
zero = 1
microbatches = 3
sp = true
)",
                          "job.toml");
  REQUIRE(j.has_value());
  grpo_job want;
  want.model_hf = "/ck/sft";
  want.task = "prompts";
  want.prompts_file = "q.jsonl";
  want.reward = "partial";
  want.chat_template = "chatml";
  want.steps = 7;
  want.prompts_per_step = 6;
  want.group = 4;
  want.max_new_tokens = 12;
  want.temperature = 0.7;
  want.top_p = 0.9;
  want.kl_coef = 0;
  want.clip_epsilon = 0.1;
  want.seed = 5;
  want.rollouts = 2;
  want.staleness = 1;
  want.log_every = 3;
  want.lr = 2e-5;
  want.warmup = 4;
  want.weight_decay = 0.01;
  want.clip = 0.5;
  want.ckpt_dir = "/ck/grpo";
  want.ckpt_every = 5;
  want.dp = want.tp = want.pp = 2;
  want.zero = 1;
  want.microbatches = 3;
  want.sp = true;
  CHECK(*j == want);
  CHECK(parse_grpo_job("", "empty.toml").value() == grpo_job{});
  CHECK_NOTHROW(grpo_job{}.validate());
}

TEST_CASE("a grpo job file's bad keys and values are refused naming the file and key",
          "[cpu][faults]") {
  const auto refused = [](const std::string& text) {
    const auto j = parse_grpo_job(text, "job.toml");
    REQUIRE_FALSE(j.has_value());
    std::string one_line = text;  // the "faults:" line is one line
    std::replace(one_line.begin(), one_line.end(), '\n', ' ');
    std::printf("faults: grpo job '%s' -> refused: %s\n", one_line.c_str(),
                j.error_message().c_str());
    return j.error_message();
  };
  CHECK_THAT(refused("[grpo]\ngroups = 4\n"), Contains("job.toml: unknown key 'grpo.groups'"));
  CHECK_THAT(refused("[parallel]\ndp = 0\n"), Contains("parallel.dp (--dp) must be in 1..4096"));
  CHECK_THAT(refused("[parallel]\ncp = 2\n"),
             Contains("job.toml: 'parallel.cp' is a key of troupe train's job files"));
  CHECK_THAT(refused("[grpo]\nsteps = 1.5\n"), Contains("job.toml: grpo.steps must be an integer"));
  CHECK_THAT(refused("[grpo]\ntemperature = \"hot\"\n"),
             Contains("grpo.temperature must be a number"));
  CHECK_THAT(refused("[grpo]\ngroup = 1\n"), Contains("grpo.group (--group) must be > 1"));
  CHECK_THAT(refused("[grpo]\nstaleness = 2\n"),
             Contains("grpo.staleness (--staleness) must be 0 (sync) or 1"));
  CHECK_THAT(refused("[grpo]\ntask = \"prompts\"\n"),
             Contains("grpo.prompts_file (--prompts) is needed by grpo.task = \"prompts\""));
  CHECK_THAT(refused("[grpo]\nprompts_file = \"q.jsonl\"\n"),
             Contains("is read only by grpo.task = \"prompts\""));
  CHECK_THAT(refused("[grpo]\ntask = \"sorting\"\n"),
             Contains("grpo.task (--task) must be \"addition\" or \"prompts\", got 'sorting'"));
  CHECK_THAT(refused("[grpo]\nrollouts = 3\n"),
             Contains("must be a multiple of grpo.rollouts (3)"));
  CHECK_THAT(refused("[grpo]\ntemplate = \"alpaca\"\n"), Contains("grpo.template (--template)"));
  CHECK_THAT(refused("[checkpoint]\nevery = 5\n"),
             Contains("checkpoint.every (--checkpoint-every) needs checkpoint.dir"));
  CHECK_THAT(refused("[grpo]\nsteps = \n"), Contains("job.toml:2:"));
  CHECK_THAT(refused("grpo = 3\n"), Contains("'grpo' must be a [section]"));
}
