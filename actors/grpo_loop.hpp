// grpo_loop: the driver of a GRPO job over the roles of actors/grpo_roles.hpp. Each iteration:
// rollout actors sample `group` completions for each prompt (the prompts split among them), the
// reward actor scores them, the reference actor gives its log-probabilities (skipped when beta is
// 0), the driver computes the group advantages (models/post/grpo_loss.hpp), the trainer takes one
// GRPO step, and its weights go to the rollout actors (versioned tensor messages).
//
// staleness 0 (sync): sampling and training alternate; batch k is sampled by the weights after k
// steps, so GRPO's ratio is 1 up to rounding. staleness 1 (async): batch k + 1 is sampled while
// the trainer trains on batch k, by the weights one step older than the trainer's (the ratio and
// its clip then matter); each rollout request says the oldest version it may use.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "actors/grpo_roles.hpp"
#include "actors/node.hpp"

namespace troupe::actors {

struct grpo_loop_options {
  std::string checkpoint;             // the HF folder GRPO starts from (policy and reference)
  std::vector<int> rollout_ranks{0};  // one rollout actor per entry
  int trainer_rank = 0, reward_rank = 0, reference_rank = 0;
  std::int64_t iterations = 20;
  std::int64_t prompts = 8;  // per iteration (a multiple of the rollout actors)
  // prompt_len: the longest prompt; a step's prompts have one length, up to it (the source's
  // vector holds `prompts` of them).
  std::int64_t prompt_len = 0, group = 8, max_new = 8;
  double temperature = 1.0, top_p = 1.0;
  std::int32_t eos = -1;
  std::uint64_t seed = 1;
  int staleness = 0;                          // 0: sync; 1: async, one step behind
  grpo_trainer_setup trainer;                 // its model field is filled in here
  std::chrono::milliseconds timeout{600000};  // for each request
  // The trainer saves its policy (HF layout) into save_dir every save_every iterations (0: none
  // but the last) and after the last; "": never.
  std::string save_dir;
  std::int64_t save_every = 0;
  // The trainer under a parallel plan (actors/rl_plan_trainer.hpp): when plan_config is set (a
  // models::to_toml train_config whose plan has plan_ranks ranks), rl_plan_trainer actors on
  // ranks 0..plan_ranks-1 train instead of one grpo_trainer on trainer_rank; its trainer fields
  // (AdamW, batch) must be those of `trainer` (the driver copies epsilon and beta from it).
  std::string plan_config;
  int plan_ranks = 0;
};

struct grpo_iteration {
  std::int64_t iteration = 0;  // 1-based
  double mean_reward = 0;
  grpo_train_reply train;
  std::int64_t sampled_by = 0;  // the weights' version that sampled the batch
  std::int64_t new_tokens = 0;
  double seconds = 0;                                // the whole iteration, as the driver saw it
  double generate_seconds = 0, logprob_seconds = 0;  // the slowest rollout actor's
  double reward_seconds = 0, reference_seconds = 0, train_seconds = 0, sync_seconds = 0;
  double wait_seconds = 0;  // the driver waiting for sampling (sync: all of it)
};

// The prompts of iteration k (0-based): [opt.prompts, L] row-major, L in 1..opt.prompt_len.
using grpo_prompt_source = std::function<std::vector<std::int32_t>(std::int64_t iteration)>;

// Spawns the roles (registered with add_grpo_roles on every rank), runs the iterations and stops
// the actors. on_iteration hears each one, on_save each save (after the iteration's line).
// Returns them all.
std::vector<grpo_iteration> run_grpo(
    node& n, const grpo_loop_options& opt, const grpo_prompt_source& prompts,
    const std::function<void(const grpo_iteration&)>& on_iteration = {},
    const std::function<void(const grpo_save_reply&, const std::string& dir)>& on_save = {});

}  // namespace troupe::actors
