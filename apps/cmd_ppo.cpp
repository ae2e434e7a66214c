// troupe ppo: PPO (models/post/ppo_loss.hpp, ppo_advantages.hpp) as the actor topology of
// actors/ppo_loop.hpp: rollout actors sample completions of each prompt with the kv cache, a
// reward actor scores them with a verifier (models/post/grpo_prompts.hpp, as troupe grpo), a
// reference actor gives the KL penalty's log-probabilities, a critic (a value head: the policy's
// trunk with a new score head, or --critic's reward-model folder) gives the values, the driver
// computes the per-token rewards, GAE and whitened advantages, the policy and the critic each take
// `epochs` steps, and the policy's weights go to the rollout actors. The job
// (models/post/ppo_job.hpp) comes from --config's TOML and the flags; what it shares with troupe
// grpo (the model, the task, the starting checkpoint) is apps/rl_run.hpp. The policy is saved in
// HF layout that troupe generate reads, the critic in the reward model's layout.
//
// It runs in one process (a coordinator and one node here, every actor on it), or under
// `troupe launch -n N`: rank 0 drives and holds the policy, critic, reward and reference actors,
// the rollout actors sit on ranks 1..N-1 (every rank reads the same job and prompts). With a plan
// (--dp, --tp, --pp, --zero, --microbatches, --sp, or [parallel]) of G = dp x tp x pp ranks the
// policy is G rl_plan_trainer actors on ranks 0..G-1 (actors/rl_plan_trainer.hpp); the rollout
// actors sit on ranks G..N-1, or on rank 0 when the plan takes every rank. The critic (a whole
// value model), the reward and the reference actors stay on rank 0. Under a plan the policy's
// entropy is reduced over the vocab-parallel head's shards (models/parallel/vocab_entropy.hpp).
#include <fmt/core.h>
#include <fmt/format.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "actors/bootstrap.hpp"
#include "actors/one_rank_job.hpp"
#include "actors/ppo_loop.hpp"
#include "actors/ppo_roles.hpp"
#include "actors/rl_plan_trainer.hpp"
#include "apps/commands.hpp"
#include "apps/post_run.hpp"
#include "apps/rl_run.hpp"
#include "models/families.hpp"
#include "models/hf/checkpoint_folder.hpp"
#include "models/hf/config.hpp"
#include "models/post/ppo_job.hpp"
#include "scheduler/plan.hpp"
#include "tensor/parallel.hpp"

namespace troupe::apps {
namespace {

using models::ppo_job;

using ppo_cli = rl_cli<ppo_job>;

// --critic: its config must read the policy's token ids and hold its rows' positions.
void check_critic(const ppo_job& j, const rl_task& t, std::int64_t seq) {
  if (j.critic_hf.empty()) return;
  auto read = models::hf::read_config(j.critic_hf);
  if (!read) throw error("critic.hf (--critic): " + read.error_message());
  const auto [vocab, positions] = models::with_family(*read, [](auto, const auto& mc) {
    return std::pair<std::int64_t, std::int64_t>(mc.vocab, mc.max_seq);
  });
  TROUPE_CHECK(vocab >= t.vocab_needed, "critic.hf (--critic) ", j.critic_hf, ": its vocabulary (",
               vocab, ") does not hold the policy's ", t.vocab_needed, " token ids");
  TROUPE_CHECK(positions >= seq, "critic.hf (--critic) ", j.critic_hf, ": its ", positions,
               " positions do not hold rows of ", seq, " tokens (prompt and completion)");
}

int run_ppo_command(const ppo_cli& c, const rl_plan_cli& pc) {
  const ppo_job j = resolve_rl_job(c, &models::load_ppo_job);
  if (c.threads > 0) parallel::set_num_threads(c.threads);
  const models::train_config plan_cfg =
      rl_plan_config(j, pc, "ppo", "ppo.prompts_per_step x ppo.samples_per_prompt");
  const int grid = plan_cfg.plan.world_size();
  const auto task = prepare_rl_task(j, "ppo");
  const std::int64_t seq = task->draw->longest() + j.max_new_tokens;
  check_critic(j, *task, seq);
  const models::grpo_verifier& verifier = *task->verifier;

  // Rank 0 (the only one in one process) drives the job.
  const auto drive = [&](actors::node& n) {
    const std::vector<std::pair<std::string, std::string>> folders{
        {"checkpoint.dir (--checkpoint-dir)", j.ckpt_dir},
        {"checkpoint.critic_dir (--critic-checkpoint-dir)", j.critic_dir()}};
    for (const auto& [key, dir] : folders) {
      if (dir.empty()) continue;  // refused now rather than at the first save
      auto line = models::hf::check_checkpoint_dir(dir);
      if (!line) throw error(key + ": " + line.error_message());
      fmt::print("{}\n", *line);
    }
    scratch_folder scratch;
    actors::ppo_loop_options o;
    o.checkpoint = rl_starting_checkpoint(j, task->mcfg, scratch, "ppo");
    o.critic_checkpoint = j.critic_hf;
    // The policy, critic, reward and reference actors on rank 0 (the driver's); under a plan the
    // policy's pieces on ranks 0..grid-1 and the rollout actors after them.
    TROUPE_CHECK(grid <= n.world_size(),
                 "troupe ppo: parallel.dp x parallel.pp x parallel.tp = ", grid,
                 " policy ranks but the job has ", n.world_size());
    o.rollout_ranks = rl_rollout_ranks(j.rollouts, n.world_size(), grid);
    o.iterations = j.steps;
    o.prompts = j.prompts_per_step;
    o.prompt_len = task->draw->longest();
    o.group = j.group;
    o.max_new = j.max_new_tokens;
    o.temperature = j.temperature;
    o.top_p = j.top_p;
    o.eos = task->stop;
    o.seed = j.seed;
    o.staleness = static_cast<int>(j.staleness);
    o.rewards.kl_coef = j.kl_coef;
    o.rewards.kl = j.kl_estimator == "k3" ? models::kl_estimator::k3 : models::kl_estimator::k1;
    o.rewards.whiten_rewards = j.whiten_rewards;
    o.rewards.gamma = j.gamma;
    o.rewards.lam = j.lam;
    for (auto* t : {&o.policy, &o.critic}) {
      t->weight_decay = j.weight_decay;
      t->clip = j.clip;
      t->beta1 = j.beta1;
      t->beta2 = j.beta2;
      t->warmup = j.warmup;
      t->epochs = j.epochs;
      t->cliprange = j.cliprange;
      t->cliprange_value = j.cliprange_value;
      t->vf_coef = j.vf_coef;
    }
    o.policy.lr = j.lr;
    o.critic.lr = j.critic_lr;
    o.critic.seed = j.seed + 2;  // the new score head's start (troupe_example_ppo's)
    o.critic.need_score = !j.critic_hf.empty();
    o.save_dir = j.ckpt_dir;
    o.critic_save_dir = j.critic_dir();
    o.save_every = j.ckpt_every;
    if (grid > 1) {
      o.plan_config = rl_plan_toml(plan_cfg, o.checkpoint, j.prompts_per_step * j.group,
                                   o.prompt_len + o.max_new, j);
      o.plan_ranks = grid;
      fmt::print("policy: {} on ranks 0..{} (rl_plan_trainer pieces); critic on rank 0\n",
                 scheduler::describe(plan_cfg.plan), grid - 1);
    }

    fmt::print("troupe ppo: {}, tokenizer {}{}; critic {}\n", task->label, task->tok->name(),
               j.chat_template.empty() ? "" : ", template " + j.chat_template,
               j.critic_hf.empty() ? "the policy's trunk with a new value head" : j.critic_hf);
    fmt::print(
        "task {}: {} prompts{}, reward {} (stop token {}), {} prompts x {} samples per step, "
        "{} epochs, kl {} x {}, gamma {}, lam {}, {} rollout actor(s) on rank(s) {}, {}\n",
        j.task, task->prompts.size(), j.task == "prompts" ? " from " + j.prompts_file : "",
        j.reward, task->stop, j.prompts_per_step, j.group, j.epochs, j.kl_coef, j.kl_estimator,
        j.gamma, j.lam, j.rollouts, fmt::join(o.rollout_ranks, " "),
        j.staleness == 1 ? "async (staleness 1)" : "sync");
    std::fflush(stdout);

    auto json = open_post_json(c.json_path);
    std::int64_t drawn = 0;
    const actors::grpo_prompt_source source = [&](std::int64_t k) {
      // Steps ask in order (async mode asks for step k + 1 while step k trains, from one thread at
      // a time), so the draw is the same for a seed whatever the staleness.
      TROUPE_CHECK(k == drawn, "troupe ppo: prompts of step ", k + 1, " asked after ", drawn);
      ++drawn;
      return task->draw->next();
    };
    double first_reward = 0, last_reward = 0;
    const auto on_step = [&](const actors::ppo_iteration& it) {
      if (it.iteration == 1) first_reward = it.mean_reward;
      last_reward = it.mean_reward;
      const double generate = it.generate_seconds + it.logprob_seconds;
      if (json) {
        fmt::print(json.get(),
                   "{{\"step\": {}, \"mean_reward\": {}, \"kl\": {}, \"non_score_reward\": {}, "
                   "\"policy_loss\": {}, \"clipfrac\": {}, \"approx_kl\": {}, \"entropy\": {}, "
                   "\"value_loss\": {}, \"value_clipfrac\": {}, \"grad_norm\": {}, "
                   "\"critic_grad_norm\": {}, \"lr\": {:.6g}, \"weights_version\": {}, "
                   "\"new_tokens\": {}, \"generate_seconds\": {}, \"sample_seconds\": {}, "
                   "\"old_logprob_seconds\": {}, \"reward_seconds\": {}, "
                   "\"values_seconds\": {}, \"train_seconds\": {}, \"sync_seconds\": {}, "
                   "\"seconds\": {}}}\n",
                   it.iteration, it.mean_reward, it.kl, it.non_score_reward, it.policy.loss,
                   it.policy.clipfrac, it.policy.approx_kl,
                   std::isnan(it.policy.entropy) ? std::string("null")
                                                 : fmt::format("{}", it.policy.entropy),
                   it.critic.loss, it.critic.clipfrac, it.policy.grad_norm, it.critic.grad_norm,
                   it.policy.lr, it.sampled_by, it.new_tokens, generate, it.generate_seconds,
                   it.logprob_seconds, it.reward_seconds, it.values_seconds, it.train_seconds,
                   it.sync_seconds, it.seconds);
        std::fflush(json.get());
      }
      if (it.iteration % j.log_every == 0 || it.iteration == j.steps || it.iteration == 1)
        fmt::print(
            "step {:4d}/{}  mean reward {:.3f}  kl {:.4f}  policy loss {:+.4f}  clipped {:.3f}  "
            "value loss {:.4f}  value clipped {:.3f}  weights v{}  generating {:.2f} s  "
            "training {:.2f} s  syncing {:.3f} s\n",
            it.iteration, j.steps, it.mean_reward, it.kl, it.policy.loss, it.policy.clipfrac,
            it.critic.loss, it.critic.clipfrac, it.sampled_by, generate, it.train_seconds,
            it.sync_seconds);
      std::fflush(stdout);
    };
    const auto on_save = [](const std::string& who, const actors::grpo_save_reply& s,
                            const std::string& dir) {
      fmt::print("{}: {}\n", who,
                 models::hf::saved_line(dir, s.version,
                                        s.held >= 0 ? std::optional(s.held) : std::nullopt));
      std::fflush(stdout);
    };

    actors::run_ppo(n, o, source, on_step, on_save);
    fmt::print("ppo: {} steps, mean reward {:.3f} (step 1) -> {:.3f} (step {})\n", j.steps,
               first_reward, last_reward, j.steps);
    if (!j.ckpt_dir.empty())
      fmt::print(
          "checkpoint: {} (HF layout; troupe generate --model {}), critic: {} (HF "
          "...ForSequenceClassification layout; troupe ppo --critic {})\n",
          j.ckpt_dir, j.ckpt_dir, j.critic_dir(), j.critic_dir());
  };

  const auto add_roles = [&](actors::role_registry& roles) {
    actors::add_ppo_roles(roles, verifier);
    actors::add_rl_plan_trainer_role(roles);
  };
  if (!actors::join_info_from_env()) {  // one process: a coordinator and one node here
    actors::one_rank_job node(add_roles, fmt::format("troupe-ppo-{}", ::getpid()));
    drive(*node.n);
    return 0;
  }
  // Under troupe launch: every rank registers the roles (each read the same job and prompts).
  actors::role_registry roles;
  add_roles(roles);
  actors::node_options no;
  no.roles = &roles;
  actors::node n(no);
  if (n.rank() == 0) drive(n);
  n.barrier("troupe ppo: done");
  n.shutdown();
  return 0;
}

void add_job_flags(CLI::App* sub, ppo_cli& c) {
  ppo_cli* p = &c;
  // A flag setting one field of the job (over --config's value when given).
  auto knob = [&]<class T>(const std::string& name, T ppo_job::*field, const std::string& help) {
    return rl_knob(sub, c, name, field, help);
  };
  c.model = c.job.model_size;
  CLI::Option* model = sub->add_option("--model", c.model,
                                       "HF model folder to start from (e.g. troupe sft's), or a "
                                       "named size built from the seed (llama-tiny, ...)");
  model->capture_default_str();
  c.overrides.emplace_back(model, [p](ppo_job& j) { set_rl_model(j, p->model); });
  c.task_flag = knob("--task", &ppo_job::task, "addition (generated a+b=) or prompts (--prompts)");
  knob("--digits", &ppo_job::digits, "addition: digits of the operands (1 or 2)");
  c.prompts_flag = knob("--prompts", &ppo_job::prompts_file,
                        "JSONL of {\"prompt\", \"answer\"} (implies --task prompts)")
                       ->check(CLI::ExistingFile);
  knob("--reward", &ppo_job::reward,
       "exact (1 or 0) or partial (share of the answer's characters in place)");
  knob("--template", &ppo_job::chat_template,
       "Chat template of the prompts: chatml or llama3 (default: raw text)");
  knob("--tokenizer", &ppo_job::tokenizer, "byte, gpt2:DIR or spm:FILE");
  knob("--steps", &ppo_job::steps, "PPO steps (one batch, `epochs` optimizer steps each)");
  knob("--prompts-per-step", &ppo_job::prompts_per_step, "Prompts per step");
  knob("--samples-per-prompt", &ppo_job::group, "Completions sampled per prompt");
  knob("--max-new-tokens", &ppo_job::max_new_tokens, "Tokens per completion at most");
  knob("--temperature", &ppo_job::temperature, "Sampling temperature");
  knob("--top-p", &ppo_job::top_p, "Nucleus sampling");
  knob("--epochs", &ppo_job::epochs, "Optimizer steps per batch, policy and critic");
  knob("--kl-coef", &ppo_job::kl_coef, "KL penalty in the reward (0: no reference actor)");
  knob("--kl-estimator", &ppo_job::kl_estimator, "k1 (log-ratio) or k3");
  knob("--whiten-rewards", &ppo_job::whiten_rewards,
       "Whiten the per-token rewards before GAE (true or false)");
  knob("--gamma", &ppo_job::gamma, "GAE discount");
  knob("--lam", &ppo_job::lam, "GAE lambda");
  knob("--cliprange", &ppo_job::cliprange, "Clip range of the policy's ratio");
  knob("--cliprange-value", &ppo_job::cliprange_value, "Clip range of the values");
  knob("--vf-coef", &ppo_job::vf_coef, "Weight of the value loss");
  knob("--critic", &ppo_job::critic_hf,
       "HF reward-model folder to start the critic from (e.g. troupe rm's; default: the "
       "policy's trunk with a new value head)");
  knob("--critic-lr", &ppo_job::critic_lr, "The critic's learning rate");
  knob("--seed", &ppo_job::seed, "Seed of the prompts, the sampling (and weights)");
  knob("--rollouts", &ppo_job::rollouts, "Rollout actors");
  knob("--staleness", &ppo_job::staleness,
       "0: sample then train (sync); 1: sample the next batch while training");
  knob("--log-every", &ppo_job::log_every, "Steps between progress lines");
  knob("--lr", &ppo_job::lr, "The policy's learning rate (constant after the warmup)");
  knob("--warmup", &ppo_job::warmup, "Warmup steps");
  knob("--weight-decay", &ppo_job::weight_decay, "AdamW weight decay");
  knob("--clip", &ppo_job::clip, "Gradient-norm clip (0: off)");
  knob("--checkpoint-dir", &ppo_job::ckpt_dir, "Folder to save the policy's HF checkpoint to");
  knob("--critic-checkpoint-dir", &ppo_job::critic_ckpt_dir,
       "Folder to save the critic to (default: the checkpoint folder's name + -critic)");
  knob("--checkpoint-every", &ppo_job::ckpt_every,
       "Steps between checkpoints (0: only at the end)");
}

}  // namespace

command_fn add_ppo_command(CLI::App& app) {
  auto c = std::make_shared<ppo_cli>();
  auto* sub = app.add_subcommand(
      "ppo", "PPO with rollout, reward, reference, critic and policy actors on a verifiable task");
  sub->add_option("--config", c->config_file,
                  "TOML job file: [model], [ppo], [critic], [optim], [checkpoint], [parallel] "
                  "(flags override it)")
      ->check(CLI::ExistingFile);
  sub->add_option("--json", c->json_path, "Per-step JSON lines to this file ('-': stdout)");
  sub->add_option("--threads", c->threads, "CPU threads (0: all)");
  add_job_flags(sub, *c);
  auto pc = std::make_shared<rl_plan_cli>();
  add_plan_flags(sub, pc->plan, pc->flags);
  return [sub, c, pc]() -> int {
    if (!sub->parsed()) return -1;
    return run_ppo_command(*c, *pc);
  };
}

}  // namespace troupe::apps
