// rollout_batch: one batch of sampled rows from the rollout actors of an RL loop (GRPO:
// grpo_loop.hpp, PPO: ppo_loop.hpp). The request is fanned out to every actor (each samples its
// share of the prompts, grpo_rollout_request::split) and their rows are joined in actor order.
#pragma once

#include <vector>

#include "actors/grpo_roles.hpp"

namespace troupe::actors {

struct rollout_batch {
  grpo_samples samples;        // every rollout actor's rows, in order; version: the oldest
  double seconds = 0;          // the slowest actor's generation
  double logprob_seconds = 0;  // the slowest actor's old log-probabilities
};

// Asks `rollouts` for r (its split is set here to their names) and joins their replies.
rollout_batch sample_rollouts(job& j, const std::vector<role_handle>& rollouts,
                              grpo_rollout_request r, std::chrono::milliseconds timeout);

}  // namespace troupe::actors
