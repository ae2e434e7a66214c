// troupe grpo: Group Relative Policy Optimization (models/post/grpo_loss.hpp) as the actor topology
// of actors/grpo_loop.hpp: rollout actors sample `group` completions per prompt with the kv cache,
// a reward actor scores them with a verifier (models/post/grpo_prompts.hpp: the prompt's answer,
// exact or partial), a reference actor gives the KL term's log-probabilities, and the trainer
// steps and pushes its weights to the rollout actors. The job (models/post/grpo_job.hpp) comes
// from --config's TOML and the flags; the policy starts from an HF folder (e.g. what troupe sft
// saved) or a named size, and is saved in HF layout that troupe generate reads.
//
// It runs in one process (a coordinator and one node here, every actor on it), or under
// `troupe launch -n N`: rank 0 drives and holds the trainer, reward and reference actors, the
// rollout actors sit on ranks 1..N-1 (every rank reads the same job and prompts).
#include <fmt/core.h>
#include <fmt/format.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "actors/bootstrap.hpp"
#include "actors/grpo_loop.hpp"
#include "actors/grpo_roles.hpp"
#include "actors/one_rank_job.hpp"
#include "apps/commands.hpp"
#include "apps/post_run.hpp"
#include "apps/rl_run.hpp"
#include "models/causal_lm.hpp"
#include "models/families.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/checkpoint_folder.hpp"
#include "models/hf/config.hpp"
#include "models/post/grpo_job.hpp"
#include "models/post/grpo_prompts.hpp"
#include "models/text/tokenizer.hpp"
#include "tensor/parallel.hpp"

namespace troupe::apps {
namespace {

namespace fs = std::filesystem;
using models::grpo_job;

struct grpo_cli {
  grpo_job job;  // the flags' values (their defaults are grpo_job's)
  std::string config_file, json_path, model;
  int threads = 0;
  // The job's flags given on the command line, applied over --config's file.
  std::vector<std::pair<CLI::Option*, std::function<void(grpo_job&)>>> overrides;
  CLI::Option *task_flag = nullptr, *prompts_flag = nullptr;
};

grpo_job resolve_job(const grpo_cli& c) {
  grpo_job j;
  if (!c.config_file.empty()) j = models::load_grpo_job(c.config_file).value();
  for (const auto& [opt, apply] : c.overrides)
    if (opt->count() > 0) apply(j);
  // --prompts FILE alone means the prompts task; with --task, the two must agree (validate).
  if (c.prompts_flag->count() > 0 && c.task_flag->count() == 0) j.task = "prompts";
  j.validate();
  return j;
}

int run_grpo_command(const grpo_cli& c) {
  const grpo_job j = resolve_job(c);
  if (c.threads > 0) parallel::set_num_threads(c.threads);

  const auto task = prepare_rl_task(j, "grpo");
  const auto& tok = task->tok;
  const auto& prompts = task->prompts;
  auto& draw = *task->draw;
  const std::string& label = task->label;
  const std::int32_t stop = task->stop;
  const models::grpo_verifier& verifier = *task->verifier;

  // Rank 0 (the only one in one process) drives the job.
  const auto drive = [&](actors::node& n) {
    if (!j.ckpt_dir.empty()) {  // refused now rather than at the first save
      auto line = models::hf::check_checkpoint_dir(j.ckpt_dir);
      if (!line) throw error("checkpoint.dir (--checkpoint-dir): " + line.error_message());
      fmt::print("{}\n", *line);
    }
    scratch_folder scratch;
    actors::grpo_loop_options o;
    o.checkpoint = rl_starting_checkpoint(j, task->mcfg, scratch, "grpo");
    // The trainer, reward and reference actors on rank 0 (the driver's).
    o.rollout_ranks = rl_rollout_ranks(j.rollouts, n.world_size());
    o.iterations = j.steps;
    o.prompts = j.prompts_per_step;
    o.prompt_len = draw.longest();
    o.group = j.group;
    o.max_new = j.max_new_tokens;
    o.temperature = j.temperature;
    o.top_p = j.top_p;
    o.eos = stop;
    o.seed = j.seed;
    o.staleness = static_cast<int>(j.staleness);
    o.trainer.lr = j.lr;
    o.trainer.weight_decay = j.weight_decay;
    o.trainer.clip = j.clip;
    o.trainer.beta1 = j.beta1;
    o.trainer.beta2 = j.beta2;
    o.trainer.warmup = j.warmup;
    o.trainer.epsilon = j.clip_epsilon;
    o.trainer.beta = j.kl_coef;
    o.save_dir = j.ckpt_dir;
    o.save_every = j.ckpt_every;

    fmt::print("troupe grpo: {}, tokenizer {}{}\n", label, tok->name(),
               j.chat_template.empty() ? "" : ", template " + j.chat_template);
    fmt::print(
        "task {}: {} prompts{}, reward {} (stop token {}), {} prompts x {} samples per step, "
        "{} rollout actor(s) on rank(s) {}, {}\n",
        j.task, prompts.size(), j.task == "prompts" ? " from " + j.prompts_file : "", j.reward,
        stop, j.prompts_per_step, j.group, j.rollouts, fmt::join(o.rollout_ranks, " "),
        j.staleness == 1 ? "async (staleness 1)" : "sync");
    std::fflush(stdout);

    auto json = open_post_json(c.json_path);
    std::int64_t drawn = 0;
    const actors::grpo_prompt_source source = [&](std::int64_t k) {
      // Steps ask in order (async mode asks for step k + 1 while step k trains, from one thread at
      // a time), so the draw is the same for a seed whatever the staleness.
      TROUPE_CHECK(k == drawn, "troupe grpo: prompts of step ", k + 1, " asked after ", drawn);
      ++drawn;
      return draw.next();
    };
    double first_reward = 0, last_reward = 0;
    const auto on_step = [&](const actors::grpo_iteration& it) {
      if (it.iteration == 1) first_reward = it.mean_reward;
      last_reward = it.mean_reward;
      const double generate = it.generate_seconds + it.logprob_seconds;
      if (json) {
        fmt::print(
            json.get(),
            "{{\"step\": {}, \"mean_reward\": {}, \"kl\": {}, \"loss\": {}, "
            "\"clip_ratio\": {}, \"grad_norm\": {}, \"lr\": {:.6g}, \"weights_version\": {}, "
            "\"new_tokens\": {}, \"generate_seconds\": {}, \"reward_seconds\": {}, "
            "\"reference_seconds\": {}, \"train_seconds\": {}, \"sync_seconds\": {}, "
            "\"seconds\": {}}}\n",
            it.iteration, it.mean_reward, it.train.kl, it.train.loss, it.train.clip_ratio,
            it.train.grad_norm, it.train.lr, it.sampled_by, it.new_tokens, generate,
            it.reward_seconds, it.reference_seconds, it.train_seconds, it.sync_seconds, it.seconds);
        std::fflush(json.get());
      }
      if (it.iteration % j.log_every == 0 || it.iteration == j.steps || it.iteration == 1)
        fmt::print(
            "step {:4d}/{}  mean reward {:.3f}  kl {:.4f}  loss {:+.4f}  clipped {:.3f}  "
            "weights v{}  generating {:.2f} s  training {:.2f} s  syncing {:.3f} s\n",
            it.iteration, j.steps, it.mean_reward, it.train.kl, it.train.loss, it.train.clip_ratio,
            it.sampled_by, generate, it.train_seconds, it.sync_seconds);
      std::fflush(stdout);
    };
    const auto on_save = [](const actors::grpo_save_reply& s, const std::string& dir) {
      fmt::print("{}\n", models::hf::saved_line(
                             dir, s.version, s.held >= 0 ? std::optional(s.held) : std::nullopt));
      std::fflush(stdout);
    };

    actors::run_grpo(n, o, source, on_step, on_save);
    fmt::print("grpo: {} steps, mean reward {:.3f} (step 1) -> {:.3f} (step {})\n", j.steps,
               first_reward, last_reward, j.steps);
    if (!j.ckpt_dir.empty())
      fmt::print("checkpoint: {} (HF layout; troupe generate --model {})\n", j.ckpt_dir,
                 j.ckpt_dir);
  };

  if (!actors::join_info_from_env()) {  // one process: a coordinator and one node here
    actors::one_rank_job node(
        [&](actors::role_registry& roles) { actors::add_grpo_roles(roles, verifier); },
        fmt::format("troupe-grpo-{}", ::getpid()));
    drive(*node.n);
    return 0;
  }
  // Under troupe launch: every rank registers the roles (each read the same job and prompts).
  actors::role_registry roles;
  actors::add_grpo_roles(roles, verifier);
  actors::node_options no;
  no.roles = &roles;
  actors::node n(no);
  if (n.rank() == 0) drive(n);
  n.barrier("troupe grpo: done");
  n.shutdown();
  return 0;
}

void add_job_flags(CLI::App* sub, grpo_cli& c) {
  grpo_cli* p = &c;
  auto knob = [&](CLI::Option* o, std::function<void(grpo_job&)> apply) {
    o->capture_default_str();
    c.overrides.emplace_back(o, std::move(apply));
  };
  c.model = c.job.model_size;
  knob(sub->add_option("--model", c.model,
                       "HF model folder to start from (e.g. troupe sft's), or a named size "
                       "built from the seed (llama-tiny, ...)"),
       [p](grpo_job& j) { set_rl_model(j, p->model); });
  c.task_flag =
      sub->add_option("--task", c.job.task, "addition (generated a+b=) or prompts (--prompts)");
  knob(c.task_flag, [p](grpo_job& j) { j.task = p->job.task; });
  knob(sub->add_option("--digits", c.job.digits, "addition: digits of the operands (1 or 2)"),
       [p](grpo_job& j) { j.digits = p->job.digits; });
  c.prompts_flag = sub->add_option("--prompts", c.job.prompts_file,
                                   "JSONL of {\"prompt\", \"answer\"} (implies --task prompts)")
                       ->check(CLI::ExistingFile);
  knob(c.prompts_flag, [p](grpo_job& j) { j.prompts_file = p->job.prompts_file; });
  knob(sub->add_option("--reward", c.job.reward,
                       "exact (1 or 0) or partial (share of the answer's characters in place)"),
       [p](grpo_job& j) { j.reward = p->job.reward; });
  knob(sub->add_option("--template", c.job.chat_template,
                       "Chat template of the prompts: chatml or llama3 (default: raw text)"),
       [p](grpo_job& j) { j.chat_template = p->job.chat_template; });
  knob(sub->add_option("--tokenizer", c.job.tokenizer, "byte, gpt2:DIR or spm:FILE"),
       [p](grpo_job& j) { j.tokenizer = p->job.tokenizer; });
  knob(sub->add_option("--steps", c.job.steps, "GRPO steps (one optimizer step each)"),
       [p](grpo_job& j) { j.steps = p->job.steps; });
  knob(sub->add_option("--prompts-per-step", c.job.prompts_per_step, "Prompts per step"),
       [p](grpo_job& j) { j.prompts_per_step = p->job.prompts_per_step; });
  knob(sub->add_option("--group", c.job.group, "Samples per prompt (the group)"),
       [p](grpo_job& j) { j.group = p->job.group; });
  knob(sub->add_option("--max-new-tokens", c.job.max_new_tokens, "Tokens per completion at most"),
       [p](grpo_job& j) { j.max_new_tokens = p->job.max_new_tokens; });
  knob(sub->add_option("--temperature", c.job.temperature, "Sampling temperature"),
       [p](grpo_job& j) { j.temperature = p->job.temperature; });
  knob(sub->add_option("--top-p", c.job.top_p, "Nucleus sampling"),
       [p](grpo_job& j) { j.top_p = p->job.top_p; });
  knob(sub->add_option("--kl-coef", c.job.kl_coef, "KL coefficient (0: no reference actor)"),
       [p](grpo_job& j) { j.kl_coef = p->job.kl_coef; });
  knob(sub->add_option("--clip-epsilon", c.job.clip_epsilon, "Clip range of the ratio"),
       [p](grpo_job& j) { j.clip_epsilon = p->job.clip_epsilon; });
  knob(sub->add_option("--seed", c.job.seed, "Seed of the prompts, the sampling (and weights)"),
       [p](grpo_job& j) { j.seed = p->job.seed; });
  knob(sub->add_option("--rollouts", c.job.rollouts, "Rollout actors"),
       [p](grpo_job& j) { j.rollouts = p->job.rollouts; });
  knob(sub->add_option("--staleness", c.job.staleness,
                       "0: sample then train (sync); 1: sample the next batch while training"),
       [p](grpo_job& j) { j.staleness = p->job.staleness; });
  knob(sub->add_option("--log-every", c.job.log_every, "Steps between progress lines"),
       [p](grpo_job& j) { j.log_every = p->job.log_every; });
  knob(sub->add_option("--lr", c.job.lr, "Learning rate (constant after the warmup)"),
       [p](grpo_job& j) { j.lr = p->job.lr; });
  knob(sub->add_option("--warmup", c.job.warmup, "Warmup steps"),
       [p](grpo_job& j) { j.warmup = p->job.warmup; });
  knob(sub->add_option("--weight-decay", c.job.weight_decay, "AdamW weight decay"),
       [p](grpo_job& j) { j.weight_decay = p->job.weight_decay; });
  knob(sub->add_option("--clip", c.job.clip, "Gradient-norm clip (0: off)"),
       [p](grpo_job& j) { j.clip = p->job.clip; });
  knob(sub->add_option("--checkpoint-dir", c.job.ckpt_dir, "Folder to save the HF checkpoint to"),
       [p](grpo_job& j) { j.ckpt_dir = p->job.ckpt_dir; });
  knob(sub->add_option("--checkpoint-every", c.job.ckpt_every,
                       "Steps between checkpoints (0: only at the end)"),
       [p](grpo_job& j) { j.ckpt_every = p->job.ckpt_every; });
}

}  // namespace

command_fn add_grpo_command(CLI::App& app) {
  auto c = std::make_shared<grpo_cli>();
  auto* sub = app.add_subcommand(
      "grpo", "GRPO with rollout, reward, reference and trainer actors on a verifiable task");
  sub->add_option("--config", c->config_file,
                  "TOML job file: [model], [grpo], [optim], [checkpoint] (flags override it)")
      ->check(CLI::ExistingFile);
  sub->add_option("--json", c->json_path, "Per-step JSON lines to this file ('-': stdout)");
  sub->add_option("--threads", c->threads, "CPU threads (0: all)");
  add_job_flags(sub, *c);
  return [sub, c]() -> int {
    if (!sub->parsed()) return -1;
    return run_grpo_command(*c);
  };
}

}  // namespace troupe::apps
