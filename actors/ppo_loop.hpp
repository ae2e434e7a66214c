// ppo_loop: the driver of a PPO job over the roles of actors/ppo_roles.hpp (GRPO's rollout,
// reward and reference roles; ppo_policy and ppo_critic). Each iteration: rollout actors sample
// `group` completions per prompt with the old log-probabilities, the reward actor scores them,
// the reference actor gives its log-probabilities (skipped when kl_coef is 0) while the critic
// gives its values, the driver computes the per-token rewards, GAE, whitened advantages and
// returns (models/post/ppo_advantages.hpp), the policy and the critic each take `epochs` steps
// (at the same time, on their own actors), and the policy's weights go to the rollout actors.
//
// staleness 0 (sync): batch k is sampled by the policy's weights after k updates. staleness 1
// (async): batch k + 1 is sampled while the policy trains on batch k, by the weights one update
// older (each rollout request names the oldest version it may use).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "actors/grpo_loop.hpp"
#include "actors/ppo_roles.hpp"
#include "models/post/ppo_advantages.hpp"

namespace troupe::actors {

struct ppo_loop_options {
  std::string checkpoint;  // the HF folder PPO starts from (policy, reference, critic's trunk)
  // The critic's start when set: an HF folder, e.g. a reward model's (its score head too).
  std::string critic_checkpoint;
  std::vector<int> rollout_ranks{0};  // one rollout actor per entry
  int policy_rank = 0, critic_rank = 0, reward_rank = 0, reference_rank = 0;
  std::int64_t iterations = 20;
  std::int64_t prompts = 8;  // per iteration (a multiple of the rollout actors)
  std::int64_t prompt_len = 0, group = 1, max_new = 8;
  double temperature = 1.0, top_p = 1.0;
  std::int32_t eos = -1;
  std::uint64_t seed = 1;
  int staleness = 0;                          // 0: sync; 1: async, one update behind
  models::ppo_reward_options rewards;         // KL penalty, gamma, lambda
  ppo_trainer_setup policy, critic;           // their model fields are filled in here
  std::chrono::milliseconds timeout{600000};  // for each request
  // The policy saves itself (HF layout) into save_dir, the critic (reward-model layout) into
  // critic_save_dir, every save_every iterations (0: none but the last) and after the last; an
  // empty folder is not saved.
  std::string save_dir, critic_save_dir;
  std::int64_t save_every = 0;
  // The policy under a parallel plan (actors/rl_plan_trainer.hpp): when plan_config is set (a
  // models::to_toml train_config whose plan has plan_ranks ranks), rl_plan_trainer actors on
  // ranks 0..plan_ranks-1 train the policy instead of one ppo_policy on policy_rank (with
  // `policy`'s epochs and cliprange). The critic stays one ppo_critic actor on critic_rank.
  std::string plan_config;
  int plan_ranks = 0;
};

struct ppo_iteration {
  std::int64_t iteration = 0;  // 1-based
  double mean_reward = 0;      // of the scores (the reward actor's)
  double kl = 0;               // mean over rows of the summed per-token KL to the reference
  double non_score_reward = 0;
  ppo_train_reply policy, critic;
  std::int64_t sampled_by = 0;  // the weights' version that sampled the batch
  std::int64_t new_tokens = 0;
  double seconds = 0;                                // the whole iteration, as the driver saw it
  double generate_seconds = 0, logprob_seconds = 0;  // the slowest rollout actor's
  double reward_seconds = 0;
  double values_seconds = 0;  // the reference's log-probabilities and the critic's values, together
  double train_seconds = 0;   // the policy's and the critic's epochs, together
  double sync_seconds = 0;
  double wait_seconds = 0;  // the driver waiting for sampling (sync: all of it)
};

// What on_save hears: which model ("policy" or "critic"), the reply and the folder.
using ppo_save_fn =
    std::function<void(const std::string& who, const grpo_save_reply&, const std::string& dir)>;

// Spawns the roles (registered with add_ppo_roles on every rank), runs the iterations and stops
// the actors. on_iteration hears each one, on_save each save (after the iteration's line).
// Returns them all. A step's prompts may be shorter than prompt_len (one length per step).
std::vector<ppo_iteration> run_ppo(
    node& n, const ppo_loop_options& opt, const grpo_prompt_source& prompts,
    const std::function<void(const ppo_iteration&)>& on_iteration = {},
    const ppo_save_fn& on_save = {});

}  // namespace troupe::actors
