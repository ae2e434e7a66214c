// rl_run: what troupe grpo and troupe ppo share (apps/cmd_grpo.cpp, apps/cmd_ppo.cpp): --model
// as a folder or a named size, the task (the tokenizer with the template's special tokens, the
// model's config checked against them, the prompts: generated additions or a JSONL file, their
// draw per step, the stop token and the verifier), the starting checkpoint (the HF folder, or the
// named size initialised from the seed into a scratch folder removed at the end), and the
// rollout actors' ranks. Job is grpo_job or ppo_job (the same names for the same knobs); errors
// name "section.key (--flag)" with the command's section ("grpo", "ppo").
#pragma once

#include <fmt/core.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "actors/bootstrap.hpp"
#include "actors/rl_model.hpp"
#include "apps/plan_flags.hpp"
#include "apps/post_launched.hpp"
#include "memory/error.hpp"
#include "models/causal_lm.hpp"
#include "models/families.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/config.hpp"
#include "models/post/grpo_prompts.hpp"
#include "models/text/tokenizer.hpp"
#include "models/train_config.hpp"

namespace troupe::apps {

// The command line of troupe grpo / ppo: the job's flags (their defaults are Job's), --config,
// --json, --model, --threads, and the job flags given, applied over --config's file.
template <class Job>
struct rl_cli {
  Job job;
  std::string config_file, json_path, model;
  int threads = 0;
  std::vector<std::pair<CLI::Option*, std::function<void(Job&)>>> overrides;
  CLI::Option *task_flag = nullptr, *prompts_flag = nullptr;
};

// A flag setting one field of the job (over --config's value when given).
template <class Job, class T>
CLI::Option* rl_knob(CLI::App* sub, rl_cli<Job>& c, const std::string& name, T Job::*field,
                     const std::string& help) {
  CLI::Option* o = sub->add_option(name, c.job.*field, help);
  o->capture_default_str();
  rl_cli<Job>* p = &c;
  c.overrides.emplace_back(o, [p, field](Job& j) { j.*field = p->job.*field; });
  return o;
}

// --config's job (load: load_grpo_job, load_ppo_job), the flags given over it, validated.
// --prompts FILE alone means the prompts task; with --task, the two must agree (validate).
template <class Job>
Job resolve_rl_job(const rl_cli<Job>& c, expected<Job> (*load)(const std::string&)) {
  Job j;
  if (!c.config_file.empty()) j = load(c.config_file).value();
  for (const auto& [opt, apply] : c.overrides)
    if (opt->count() > 0) apply(j);
  if (c.prompts_flag->count() > 0 && c.task_flag->count() == 0) j.task = "prompts";
  j.validate();
  return j;
}

// --model: an HF folder when it is a directory or a path (a missing folder is then refused
// naming it), else a named size.
template <class Job>
void set_rl_model(Job& j, const std::string& model) {
  if (std::filesystem::is_directory(model) || model.find('/') != std::string::npos) {
    j.model_hf = model;
  } else {
    j.model_hf.clear();
    j.model_size = model;
  }
}

struct rl_task {
  std::shared_ptr<models::tokenizer> tok;
  models::grpo_prompt_style style;
  std::int64_t vocab_needed = 0;  // the tokenizer's ids and the template's tokens
  models::hf::model_config mcfg;
  std::string label;  // the model, for the log
  std::int64_t positions = 0;
  std::vector<models::grpo_prompt> prompts;
  std::unique_ptr<models::grpo_prompt_draw> draw;  // over `prompts`
  std::int32_t stop = -1;
  std::unique_ptr<models::grpo_verifier> verifier;
};

template <class Job>
std::unique_ptr<rl_task> prepare_rl_task(const Job& j, const std::string& section) {
  auto t = std::make_unique<rl_task>();
  t->tok = models::load_tokenizer(j.tokenizer).value();
  t->vocab_needed = t->tok->vocab_size();
  if (!j.chat_template.empty()) {
    t->style.format = models::parse_chat_format(j.chat_template).value();
    t->style.specials = models::chat_specials::appended(*t->style.format, t->tok->vocab_size());
    t->vocab_needed = t->style.specials.end();
  }
  auto read = j.model_hf.empty() ? models::named_model_config(j.model_size, t->vocab_needed)
                                 : models::hf::read_config(j.model_hf);
  if (!read)
    throw error(std::string(j.model_hf.empty() ? "model.size" : "model.hf") +
                " (--model): " + read.error_message());
  t->mcfg = *read;
  const auto [vocab, positions] = models::with_family(t->mcfg, [](auto, const auto& mc) {
    return std::pair<std::int64_t, std::int64_t>(mc.vocab, mc.max_seq);
  });
  t->positions = positions;
  t->label = j.model_hf.empty() ? j.model_size : j.model_hf;
  TROUPE_CHECK(vocab >= t->vocab_needed, "model.hf (--model) ", t->label, ": its vocabulary (",
               vocab, ") does not hold the ", t->vocab_needed, " ids of tokenizer ", t->tok->name(),
               j.chat_template.empty() ? "" : " and the " + j.chat_template + " template's tokens");
  const std::int64_t room = positions - j.max_new_tokens;
  TROUPE_CHECK(room > 0, section, ".max_new_tokens (--max-new-tokens) ", j.max_new_tokens,
               " leaves no room for a prompt in the model's ", positions, " positions");
  t->prompts = j.task == "addition"
                   ? models::addition_prompts(static_cast<int>(j.digits), *t->tok, t->style)
                   : models::read_grpo_prompts(j.prompts_file, *t->tok, t->style, room).value();
  t->draw = std::make_unique<models::grpo_prompt_draw>(t->prompts, j.prompts_per_step, j.seed + 1);
  TROUPE_CHECK(t->draw->longest() <= room, section, ".task ", j.task, ": prompts of ",
               t->draw->longest(), " tokens and ", section, ".max_new_tokens ", j.max_new_tokens,
               " exceed the model's ", positions, " positions");
  t->stop = models::completion_stop(*t->tok, t->style).value();
  t->verifier =
      std::make_unique<models::grpo_verifier>(t->tok, t->prompts, t->stop, j.reward == "partial");
  return t;
}

// Removes the scratch folder of a named size's initial weights when the run ends, however.
struct scratch_folder {
  std::filesystem::path path;
  scratch_folder() = default;
  scratch_folder(const scratch_folder&) = delete;
  scratch_folder& operator=(const scratch_folder&) = delete;
  ~scratch_folder() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

// The folder the actors load the policy from: model.hf, or the named size initialised from the
// seed and saved into `scratch` (named after the command and the process).
template <class Job>
std::string rl_starting_checkpoint(const Job& j, const models::hf::model_config& mcfg,
                                   scratch_folder& scratch, const std::string& command) {
  if (!j.model_hf.empty()) return j.model_hf;
  scratch.path = std::filesystem::temp_directory_path() /
                 fmt::format("troupe-{}-init-{}", command, ::getpid());
  auto m = models::make_causal_lm(mcfg, {1, 2});
  m->init_weights(j.seed);
  models::hf::save_checkpoint(scratch.path, mcfg, m->slots()).value();
  return scratch.path.string();
}

// One node: every rollout actor on it (rank 0). Launched on world > 1 ranks: rollout actor i on
// rank first + i % (world - first) (first: the ranks before it hold the trainer, 1 or a plan's
// grid); when no rank is left after them, on rank 0. The other actors stay with the driver on
// rank 0.
inline std::vector<int> rl_rollout_ranks(std::int64_t rollouts, int world, int first = 1) {
  std::vector<int> out;
  for (std::int64_t i = 0; i < rollouts; ++i)
    out.push_back(world > first ? first + static_cast<int>(i % (world - first)) : 0);
  return out;
}

// The policy trainer's plan flags (apps/plan_flags.hpp), applied over the job's [parallel].
struct rl_plan_cli {
  plan_cli plan;
  config_flags flags;
};

// The policy trainer's plan: the job's [parallel] with the plan flags given over it. Refuses by
// name, on every rank before it joins, what an RL loop under a plan does not do (cp, ep, 16-bit:
// refuse_unlaunchable), a plan of several ranks in one process, a grid larger than the launched
// job and rows that do not split over dp x microbatches (rows_keys: the job's keys of a step's
// rows, e.g. "grpo.prompts_per_step x grpo.group").
template <class Job>
models::train_config rl_plan_config(const Job& j, const rl_plan_cli& p, const char* command,
                                    const std::string& rows_keys) {
  models::train_config tc;
  tc.plan.dp = static_cast<int>(j.dp);
  tc.plan.tp = static_cast<int>(j.tp);
  tc.plan.pp = static_cast<int>(j.pp);
  tc.plan.zero = static_cast<int>(j.zero);
  tc.plan.microbatches = static_cast<int>(j.microbatches);
  tc.plan.sp = j.sp;
  apply_given(p.flags, tc);
  refuse_unlaunchable(command, tc);
  const std::int64_t rows = j.prompts_per_step * j.group,
                     slots = std::int64_t{tc.plan.dp} * tc.plan.microbatches;
  TROUPE_CHECK(tc.plan.dp >= 1 && tc.plan.microbatches >= 1 && rows % slots == 0, "troupe ",
               command, ": ", rows_keys, " = ", j.prompts_per_step, " x ", j.group, " = ", rows,
               " rows per step do not split over parallel.dp (--dp) ", tc.plan.dp,
               " x parallel.microbatches (--microbatches) ", tc.plan.microbatches);
  auto launched = actors::join_info_from_env();
  if (!launched) refuse_plan_in_one_process(command, tc);
  const int grid = tc.plan.world_size();
  if (launched && launched->world_size > 0)
    TROUPE_CHECK(grid <= launched->world_size, "troupe ", command,
                 ": parallel.dp x parallel.pp x parallel.tp = ", tc.plan.dp, " x ", tc.plan.pp,
                 " x ", tc.plan.tp, " = ", grid, " trainer ranks but the job has ",
                 launched->world_size, " (troupe launch -n)");
  return tc;
}

// The TOML of the policy trainer's train_config under `plan` (rl_plan_trainer's setup): the
// single-process trainer's settings (actors::rl_train_config: the job's AdamW, the step's rows x
// seq) with the plan, the weights from `checkpoint`.
template <class Job>
std::string rl_plan_toml(const models::train_config& plan, const std::string& checkpoint,
                         std::int64_t rows, std::int64_t seq, const Job& j) {
  models::train_config tc = actors::rl_train_config({checkpoint, rows, seq}, j.lr, j.weight_decay,
                                                    j.clip, j.beta1, j.beta2, j.warmup);
  tc.plan = plan.plan;
  tc.model_hf = checkpoint;
  return models::to_toml(tc);
}

}  // namespace troupe::apps
