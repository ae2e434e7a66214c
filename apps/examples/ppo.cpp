// An actor script for PPO on the GRPO example's verifiable task (addition_task.hpp): a tiny Llama
// (2 x 64, byte tokens) first SFT'd from scratch in this process on sums of which half
// (--sft-noise) are replaced by random numbers, then trained by PPO (actors/ppo_loop.hpp) with a
// C++ verifier as the score (1 when the completion is exactly the sum and a newline, else 0):
// GRPO's rollout, reward and reference actors, a policy trainer and a critic (a value head on the
// SFT trunk). Per-token rewards are the KL penalty to the reference and the score on the last
// token; GAE gives the advantages and the critic's returns. It prints the mean reward of every
// iteration (the share of sampled answers that are right).
//
//   build/apps/troupe launch -n 1 -- build/apps/examples/troupe_example_ppo
//   ... --iterations 30 --async --rollouts 2 --kl-coef 0
//
// Every actor sits on rank 0, or with --spread under `troupe launch -n 2` (or more) the rollout
// actors on ranks 1.. and the critic and the reference on the last rank: the samples, values and
// log-probabilities then travel as messages and the weights as tensor messages between processes.
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "actors/node.hpp"
#include "actors/ppo_loop.hpp"
#include "actors/ppo_roles.hpp"
#include "apps/examples/addition_task.hpp"

using namespace troupe;

int main(int argc, char** argv) {
  actors::ppo_loop_options o;
  o.iterations = 30;
  o.prompts = 16;
  o.group = 8;
  examples::addition_task task;
  o.eos = examples::addition_task::eos;
  o.policy.lr = 1e-3;
  o.policy.epochs = 2;
  o.critic.lr = 1e-3;
  o.critic.epochs = 2;
  o.rewards.kl_coef = 0.05;
  std::int64_t sft_steps = 600;
  double sft_lr = 3e-3, sft_noise = 0.5;
  int rollouts = 1;
  bool async = false, k3 = false, spread = false;
  std::string dir = fmt::format("/tmp/troupe-ppo-example-{}", ::getpid());

  CLI::App app("PPO on addition with a C++ verifier (under troupe launch -n 1)");
  app.add_option("--iterations", o.iterations, "PPO iterations")->capture_default_str();
  app.add_option("--sft-steps", sft_steps, "SFT steps from scratch first")->capture_default_str();
  app.add_option("--sft-lr", sft_lr, "SFT learning rate")->capture_default_str();
  app.add_option("--sft-noise", sft_noise, "Share of SFT answers replaced by a random number")
      ->capture_default_str();
  app.add_option("--digits", task.digits, "Digits of the operands")
      ->check(CLI::Range(1, 2))
      ->capture_default_str();
  app.add_option("--prompts", o.prompts, "Prompts per iteration")->capture_default_str();
  app.add_option("--group", o.group, "Completions per prompt")->capture_default_str();
  app.add_option("--lr", o.policy.lr, "Policy learning rate")->capture_default_str();
  app.add_option("--critic-lr", o.critic.lr, "Critic learning rate")->capture_default_str();
  app.add_option("--epochs", o.policy.epochs, "Optimizer steps per batch (policy and critic)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--kl-coef", o.rewards.kl_coef, "KL penalty in the reward (0: no reference)")
      ->capture_default_str();
  app.add_flag("--k3", k3, "The k3 KL estimator instead of k1");
  app.add_option("--gamma", o.rewards.gamma, "GAE discount")->capture_default_str();
  app.add_option("--lam", o.rewards.lam, "GAE lambda")->capture_default_str();
  app.add_option("--cliprange", o.policy.cliprange, "Ratio clip range")->capture_default_str();
  app.add_option("--cliprange-value", o.critic.cliprange_value, "Value clip range")
      ->capture_default_str();
  app.add_option("--temperature", o.temperature, "Sampling temperature")->capture_default_str();
  app.add_option("--rollouts", rollouts, "Rollout actors")->capture_default_str();
  app.add_flag("--async", async, "Sample the next batch while training (staleness 1)");
  app.add_flag("--spread", spread,
               "Rollout actors on ranks 1.., the critic and the reference on the last rank "
               "(the policy and the reward stay on rank 0)");
  app.add_option("--seed", o.seed, "Seed of the model, the data and the sampling")
      ->capture_default_str();
  app.add_option("--dir", dir, "Where the SFT checkpoint is written")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  o.prompt_len = task.prompt_len();
  o.max_new = task.max_new();
  o.staleness = async ? 1 : 0;
  o.critic.epochs = o.policy.epochs;
  o.critic.seed = o.seed + 2;  // the score head's start
  o.rewards.kl = k3 ? models::kl_estimator::k3 : models::kl_estimator::k1;
  o.rollout_ranks.assign(static_cast<std::size_t>(rollouts), 0);

  try {
    actors::role_registry roles;
    actors::add_ppo_roles(
        roles, [&task](std::span<const std::int32_t> p, std::span<const std::int32_t> c) {
          return task.verify(p, c);
        });
    actors::node_options no;
    no.roles = &roles;
    actors::node n(no);
    if (n.rank() == 0) {
      if (spread && n.world_size() > 1) {
        const int others = n.world_size() - 1;
        for (std::size_t i = 0; i < o.rollout_ranks.size(); ++i)
          o.rollout_ranks[i] = 1 + static_cast<int>(i) % others;
        o.critic_rank = o.reference_rank = n.world_size() - 1;
      }
      o.checkpoint =
          task.sft(std::filesystem::path(dir) / "sft", sft_steps, o.seed, sft_lr, sft_noise)
              .string();
      std::mt19937_64 g(o.seed + 1);
      auto prompts = [&](std::int64_t) { return task.prompts(g, o.prompts); };
      fmt::print("ppo: {} prompts x {} samples per iteration, {} epochs, {} rollout actor(s), {}\n",
                 o.prompts, o.group, o.policy.epochs, rollouts,
                 async ? "async (staleness 1)" : "sync");
      fmt::print(
          "ppo: rollout actors on ranks {}, policy and reward on rank 0, critic on rank {}, "
          "reference on rank {}\n",
          fmt::join(o.rollout_ranks, ","), o.critic_rank, o.reference_rank);
      double gen = 0, logp = 0, reward = 0, values = 0, train = 0, sync = 0, wait = 0, total = 0;
      std::int64_t tokens = 0;
      actors::run_ppo(n, o, prompts, [&](const actors::ppo_iteration& it) {
        fmt::print(
            "iteration {:3d}  mean reward {:.3f}  kl {:.4f}  pg loss {:+.4f}  clipped {:.3f}  "
            "entropy {:.3f}  vf loss {:.4f}  vf clipped {:.3f}  weights v{}  generate {:.2f} s  "
            "train {:.2f} s  sync {:.3f} s\n",
            it.iteration, it.mean_reward, it.kl, it.policy.loss, it.policy.clipfrac,
            it.policy.entropy, it.critic.loss, it.critic.clipfrac, it.sampled_by,
            it.generate_seconds + it.logprob_seconds, it.train_seconds, it.sync_seconds);
        std::fflush(stdout);
        gen += it.generate_seconds;
        logp += it.logprob_seconds;
        reward += it.reward_seconds;
        values += it.values_seconds;
        train += it.train_seconds;
        sync += it.sync_seconds;
        wait += it.wait_seconds;
        total += it.seconds;
        tokens += it.new_tokens;
      });
      // Shares of the driver's time. Generating and the old log-probabilities run in the rollout
      // actors; the driver waits for them (sync: all of it; async: what training did not hide).
      auto pct = [&](double x) { return 100 * x / total; };
      fmt::print(
          "rollout {:.0f} tokens/s ({} tokens in {:.2f} s); of {:.2f} s: waiting for rollouts "
          "{:.0f}% (generating {:.0f}%, old log-probs {:.0f}%), reward {:.0f}%, reference and "
          "values {:.0f}%, training (policy and critic) {:.0f}%, weight sync {:.1f}%\n",
          static_cast<double>(tokens) / gen, tokens, gen, total, pct(wait), pct(gen), pct(logp),
          pct(reward), pct(values), pct(train), pct(sync));
      std::filesystem::remove_all(dir);
    }
    n.barrier("ppo: done");
    n.shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe_example_ppo: %s\n", e.what());
    return 1;
  }
  return 0;
}
