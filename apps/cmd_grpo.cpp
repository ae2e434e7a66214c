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
// rollout actors sit on ranks 1..N-1 (every rank reads the same job and prompts). With a plan
// (--dp, --tp, --pp, --zero, --microbatches, --sp, or [parallel]) of G = dp x tp x pp ranks the
// trainer is G rl_plan_trainer actors on ranks 0..G-1 (actors/rl_plan_trainer.hpp), each
// stepping its piece on the step's whole batch; the rollout actors sit on ranks G..N-1, or on
// rank 0 when the plan takes every rank. The reward and reference actors stay on rank 0.
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
#include "actors/rl_model.hpp"
#include "actors/rl_plan_trainer.hpp"
#include "apps/commands.hpp"
#include "apps/plan_flags.hpp"
#include "apps/post_launched.hpp"
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
#include "models/train_config.hpp"
#include "scheduler/plan.hpp"
#include "tensor/parallel.hpp"

namespace troupe::apps {
namespace {

namespace fs = std::filesystem;
using models::grpo_job;

using grpo_cli = rl_cli<grpo_job>;

int run_grpo_command(const grpo_cli& c, const rl_plan_cli& pc) {
  const grpo_job j = resolve_rl_job(c, &models::load_grpo_job);
  if (c.threads > 0) parallel::set_num_threads(c.threads);
  const models::train_config plan_cfg =
      rl_plan_config(j, pc, "grpo", "grpo.prompts_per_step x grpo.group");
  const int grid = plan_cfg.plan.world_size();

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
    // The trainer, reward and reference actors on rank 0 (the driver's); under a plan the
    // trainer's pieces on ranks 0..grid-1 and the rollout actors after them.
    TROUPE_CHECK(grid <= n.world_size(),
                 "troupe grpo: parallel.dp x parallel.pp x parallel.tp = ", grid,
                 " trainer ranks but the job has ", n.world_size());
    o.rollout_ranks = rl_rollout_ranks(j.rollouts, n.world_size(), grid);
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
    if (grid > 1) {
      o.plan_config = rl_plan_toml(plan_cfg, o.checkpoint, j.prompts_per_step * j.group,
                                   o.prompt_len + o.max_new, j);
      o.plan_ranks = grid;
      fmt::print("trainer: {} on ranks 0..{} (rl_plan_trainer pieces)\n",
                 scheduler::describe(plan_cfg.plan), grid - 1);
    }

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
            "\"new_tokens\": {}, \"generate_seconds\": {}, \"sample_seconds\": {}, "
            "\"old_logprob_seconds\": {}, \"reward_seconds\": {}, "
            "\"reference_seconds\": {}, \"train_seconds\": {}, \"sync_seconds\": {}, "
            "\"seconds\": {}}}\n",
            it.iteration, it.mean_reward, it.train.kl, it.train.loss, it.train.clip_ratio,
            it.train.grad_norm, it.train.lr, it.sampled_by, it.new_tokens, generate,
            it.generate_seconds, it.logprob_seconds, it.reward_seconds, it.reference_seconds,
            it.train_seconds, it.sync_seconds, it.seconds);
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
        [&](actors::role_registry& roles) {
          actors::add_grpo_roles(roles, verifier);
          actors::add_rl_plan_trainer_role(roles);
        },
        fmt::format("troupe-grpo-{}", ::getpid()));
    drive(*node.n);
    return 0;
  }
  // Under troupe launch: every rank registers the roles (each read the same job and prompts).
  actors::role_registry roles;
  actors::add_grpo_roles(roles, verifier);
  actors::add_rl_plan_trainer_role(roles);
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
  auto knob = [&]<class T>(const std::string& name, T grpo_job::*field, const std::string& help) {
    return rl_knob(sub, c, name, field, help);
  };
  c.model = c.job.model_size;
  CLI::Option* model = sub->add_option("--model", c.model,
                                       "HF model folder to start from (e.g. troupe sft's), or a "
                                       "named size built from the seed (llama-tiny, ...)");
  model->capture_default_str();
  c.overrides.emplace_back(model, [p](grpo_job& j) { set_rl_model(j, p->model); });
  c.task_flag = knob("--task", &grpo_job::task, "addition (generated a+b=) or prompts (--prompts)");
  knob("--digits", &grpo_job::digits, "addition: digits of the operands (1 or 2)");
  c.prompts_flag = knob("--prompts", &grpo_job::prompts_file,
                        "JSONL of {\"prompt\", \"answer\"} (implies --task prompts)")
                       ->check(CLI::ExistingFile);
  knob("--reward", &grpo_job::reward,
       "exact (1 or 0) or partial (share of the answer's characters in place)");
  knob("--template", &grpo_job::chat_template,
       "Chat template of the prompts: chatml or llama3 (default: raw text)");
  knob("--tokenizer", &grpo_job::tokenizer, "byte, gpt2:DIR or spm:FILE");
  knob("--steps", &grpo_job::steps, "GRPO steps (one optimizer step each)");
  knob("--prompts-per-step", &grpo_job::prompts_per_step, "Prompts per step");
  knob("--group", &grpo_job::group, "Samples per prompt (the group)");
  knob("--max-new-tokens", &grpo_job::max_new_tokens, "Tokens per completion at most");
  knob("--temperature", &grpo_job::temperature, "Sampling temperature");
  knob("--top-p", &grpo_job::top_p, "Nucleus sampling");
  knob("--kl-coef", &grpo_job::kl_coef, "KL coefficient (0: no reference actor)");
  knob("--clip-epsilon", &grpo_job::clip_epsilon, "Clip range of the ratio");
  knob("--seed", &grpo_job::seed, "Seed of the prompts, the sampling (and weights)");
  knob("--rollouts", &grpo_job::rollouts, "Rollout actors");
  knob("--staleness", &grpo_job::staleness,
       "0: sample then train (sync); 1: sample the next batch while training");
  knob("--log-every", &grpo_job::log_every, "Steps between progress lines");
  knob("--lr", &grpo_job::lr, "Learning rate (constant after the warmup)");
  knob("--warmup", &grpo_job::warmup, "Warmup steps");
  knob("--weight-decay", &grpo_job::weight_decay, "AdamW weight decay");
  knob("--clip", &grpo_job::clip, "Gradient-norm clip (0: off)");
  knob("--checkpoint-dir", &grpo_job::ckpt_dir, "Folder to save the HF checkpoint to");
  knob("--checkpoint-every", &grpo_job::ckpt_every,
       "Steps between checkpoints (0: only at the end)");
}

}  // namespace

command_fn add_grpo_command(CLI::App& app) {
  auto c = std::make_shared<grpo_cli>();
  auto* sub = app.add_subcommand(
      "grpo", "GRPO with rollout, reward, reference and trainer actors on a verifiable task");
  sub->add_option(
         "--config", c->config_file,
         "TOML job file: [model], [grpo], [optim], [checkpoint], [parallel] (flags override "
         "it)")
      ->check(CLI::ExistingFile);
  sub->add_option("--json", c->json_path, "Per-step JSON lines to this file ('-': stdout)");
  sub->add_option("--threads", c->threads, "CPU threads (0: all)");
  add_job_flags(sub, *c);
  auto pc = std::make_shared<rl_plan_cli>();
  add_plan_flags(sub, pc->plan, pc->flags);
  return [sub, c, pc]() -> int {
    if (!sub->parsed()) return -1;
    return run_grpo_command(*c, *pc);
  };
}

}  // namespace troupe::apps
