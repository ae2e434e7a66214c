// An actor script for GRPO on a verifiable task: a tiny Llama (2 x 64, byte tokens) adds two
// numbers ("3+5=" -> "8\n"; --digits 2: "12+34=" -> "46\n"). First a short SFT from scratch in
// this process, on answers of which half (--sft-noise) are replaced by random numbers, gives it
// the format and a policy that knows the sum but samples it about half of the time; then GRPO
// (actors/grpo_loop.hpp) trains it with a C++ verifier as the reward (1 when the completion is
// exactly the sum and a newline, else 0), with rollout, reward, reference and trainer actors. It
// prints the mean reward of every iteration (the share of sampled answers that are right).
// (Without the noise, GRPO has far less to gain on this tiny model: on 2-digit sums after a clean
// SFT the mean reward stayed flat near 0.25 over 100 iterations at every learning rate tried.)
//
//   build/apps/troupe launch -n 1 -- build/apps/examples/troupe_example_grpo
//   ... --iterations 30 --rollouts 2 --async --beta 0
//
// Every actor sits on rank 0 here (the roles' messages are plain structs and the weights travel as
// tensor messages, so other placements need only other ranks in grpo_loop_options).
#include <fmt/core.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "actors/grpo_loop.hpp"
#include "actors/grpo_roles.hpp"
#include "actors/node.hpp"
#include "apps/examples/addition_task.hpp"

using namespace troupe;

int main(int argc, char** argv) {
  actors::grpo_loop_options o;
  o.iterations = 30;
  o.prompts = 16;
  o.prompt_len = 0;  // set after the flags
  o.group = 8;
  examples::addition_task task;
  o.eos = examples::addition_task::eos;
  o.trainer.lr = 1e-3;  // 3e-3 lost reward (docs/performance.md)
  o.trainer.beta = 0.04;
  o.trainer.warmup = 0;
  std::int64_t sft_steps = 600;
  double sft_lr = 3e-3, sft_noise = 0.5;
  int rollouts = 1;
  bool async = false;
  std::string dir = fmt::format("/tmp/troupe-grpo-example-{}", ::getpid());

  CLI::App app("GRPO on 2-digit addition with a C++ verifier (under troupe launch -n 1)");
  app.add_option("--iterations", o.iterations, "GRPO iterations")->capture_default_str();
  app.add_option("--sft-steps", sft_steps, "SFT steps from scratch first")->capture_default_str();
  app.add_option("--sft-lr", sft_lr, "SFT learning rate")->capture_default_str();
  app.add_option("--sft-noise", sft_noise, "Share of SFT answers replaced by a random number")
      ->capture_default_str();
  app.add_option("--digits", task.digits, "Digits of the operands")
      ->check(CLI::Range(1, 2))
      ->capture_default_str();
  app.add_option("--prompts", o.prompts, "Prompts per iteration")->capture_default_str();
  app.add_option("--group", o.group, "Completions per prompt")->capture_default_str();
  app.add_option("--lr", o.trainer.lr, "GRPO learning rate")->capture_default_str();
  app.add_option("--warmup", o.trainer.warmup, "GRPO learning rate warmup steps")
      ->capture_default_str();
  app.add_option("--beta", o.trainer.beta, "KL coefficient (0: no reference actor)")
      ->capture_default_str();
  app.add_option("--epsilon", o.trainer.epsilon, "Ratio clip range")->capture_default_str();
  app.add_option("--temperature", o.temperature, "Sampling temperature")->capture_default_str();
  app.add_option("--top-p", o.top_p, "Nucleus sampling")->capture_default_str();
  app.add_option("--rollouts", rollouts, "Rollout actors")->capture_default_str();
  app.add_flag("--async", async, "Sample the next batch while training (staleness 1)");
  std::string reward = "exact";
  app.add_option("--reward", reward, "exact (1 or 0) or digits (partial credit per character)")
      ->check(CLI::IsMember({"exact", "digits"}))
      ->capture_default_str();
  app.add_option("--seed", o.seed, "Seed of the model, the data and the sampling")
      ->capture_default_str();
  app.add_option("--dir", dir, "Where the SFT checkpoint is written")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  o.prompt_len = task.prompt_len();
  o.max_new = task.max_new();
  o.staleness = async ? 1 : 0;
  task.partial_credit = reward == "digits";
  o.rollout_ranks.assign(static_cast<std::size_t>(rollouts), 0);

  try {
    actors::role_registry roles;
    actors::add_grpo_roles(
        roles, [&task](std::span<const std::int32_t> p, std::span<const std::int32_t> c) {
          return task.verify(p, c);
        });
    actors::node_options no;
    no.roles = &roles;
    actors::node n(no);
    if (n.rank() == 0) {
      o.checkpoint =
          task.sft(std::filesystem::path(dir) / "sft", sft_steps, o.seed, sft_lr, sft_noise)
              .string();
      std::mt19937_64 g(o.seed + 1);
      auto prompts = [&](std::int64_t) { return task.prompts(g, o.prompts); };
      fmt::print("grpo: {} prompts x {} samples per iteration, {} rollout actor(s), {}\n",
                 o.prompts, o.group, rollouts, async ? "async (staleness 1)" : "sync");
      double gen = 0, logp = 0, reward = 0, ref = 0, train = 0, sync = 0, wait = 0, total = 0;
      std::int64_t tokens = 0;
      actors::run_grpo(n, o, prompts, [&](const actors::grpo_iteration& it) {
        fmt::print(
            "iteration {:3d}  mean reward {:.3f}  loss {:+.4f}  kl {:.4f}  clipped {:.3f}  "
            "weights v{}  generate {:.2f} s  train {:.2f} s  sync {:.3f} s\n",
            it.iteration, it.mean_reward, it.train.loss, it.train.kl, it.train.clip_ratio,
            it.sampled_by, it.generate_seconds + it.logprob_seconds, it.train_seconds,
            it.sync_seconds);
        std::fflush(stdout);
        gen += it.generate_seconds;
        logp += it.logprob_seconds;
        reward += it.reward_seconds;
        ref += it.reference_seconds;
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
          "{:.0f}% (generating {:.0f}%, old log-probs {:.0f}%), reward {:.0f}%, reference {:.0f}%, "
          "training {:.0f}%, weight sync {:.1f}%\n",
          static_cast<double>(tokens) / gen, tokens, gen, total, pct(wait), pct(gen), pct(logp),
          pct(reward), pct(ref), pct(train), pct(sync));
      std::filesystem::remove_all(dir);
    }
    n.barrier("grpo: done");
    n.shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe_example_grpo: %s\n", e.what());
    return 1;
  }
  return 0;
}
