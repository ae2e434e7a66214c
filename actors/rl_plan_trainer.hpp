// rl_plan_trainer: an RL loop's policy trainer under a parallel plan (issue 19): GRPO's trainer
// (actors/grpo_loop.hpp) and PPO's policy (actors/ppo_loop.hpp). Instead of one actor holding the
// whole policy (grpo_trainer, ppo_policy), a grid of dp x pp x tp "rl_plan_trainer" actors on
// ranks 0..G-1 (grid position = rank, in the plan's grid order) each hold their piece of the
// policy in a models::parallel::hybrid_trainer over UCX communicators of those ranks. The driver
// asks every one of them the same requests:
//   rl_plan_setup             the run's train_config (TOML: the plan, AdamW, batch = the step's
//                             rows, model.hf = the checkpoint the loop starts from) and the loss's
//                             settings (GRPO: epsilon, beta; PPO: cliprange, epochs)
//   grpo_train_request        GRPO: the step's whole batch of scored samples; every rank calls
//                             hybrid->step(grpo_samples(batch)) (models/post/plan_samples.hpp),
//                             which gives each dp replica its rows and each logit-holding piece
//                             its objective
//   ppo_policy_train_request  PPO: `epochs` steps of hybrid->step(ppo_samples(batch))
//   grpo_push_request         the whole policy gathered from the pieces onto rank 0 (a flat
//                             buffer in the single-process model's layout:
//                             hybrid_trainer::gather_parameters), which sends it to the rollout
//                             actors as the single trainers do (versioned tensor messages)
//   grpo_save_request         hybrid_trainer::save: the plan checkpoint in HF layout
// A train reply carries what this rank's objectives saw on tensor shard 0 (each microbatch once,
// weighted as the step weighs it); the driver sums the ranks' parts (combine_*_replies). PPO's
// entropy comes from the pieces holding the logits: each position's entropy reduced over the
// vocab-parallel head's shards (models/parallel/vocab_entropy.hpp), meaned over the completion
// tokens as the single process does.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "actors/grpo_roles.hpp"
#include "actors/ppo_roles.hpp"
#include "actors/roles.hpp"

namespace troupe::actors {

// Registers the "rl_plan_trainer" role (with the other RL roles: add_grpo_roles, add_ppo_roles).
void add_rl_plan_trainer_role(role_registry& roles);

struct rl_plan_setup {
  std::string config;                 // models::to_toml of the trainer's train_config
  double epsilon = 0.2, beta = 0.04;  // GRPO (models/post/grpo_loss.hpp)
  double cliprange = 0.2;             // PPO (models/post/ppo_loss.hpp)
  std::int64_t epochs = 1;            // PPO: optimizer steps per batch
  auto fields() { return std::tie(config, epsilon, beta, cliprange, epochs); }
};

// One rank's reply to a grpo_train_request: the step's result (every rank's loss, norm and rate
// are the step's), and what this rank's objectives saw on tensor shard 0 (each microbatch once):
// kl_part = sum over its microbatches of weight x kl, clipped and masked token counts. The
// driver sums them over the ranks: kl = sum of kl_part, clip ratio = clipped / masked.
struct grpo_plan_train_reply {
  grpo_train_reply train;
  double kl_part = 0, clipped = 0, masked = 0;
  auto fields() { return std::tie(train, kl_part, clipped, masked); }
};

// The step's reply from every rank's: the first's result with the summed KL and clip ratio.
grpo_train_reply combine_grpo_plan_replies(const std::vector<grpo_plan_train_reply>& replies);

// PPO's policy: one rank's reply to a ppo_policy_train_request, means over the epochs. Its
// train.loss, grad_norm and lr are the step's; clip_part, kl_part and entropy_part are this rank's
// share of the clip fraction, approx_kl and entropy (sums over its microbatches of weight x value).
struct ppo_plan_train_reply {
  ppo_train_reply train;
  double clip_part = 0, kl_part = 0, entropy_part = 0;
  auto fields() { return std::tie(train, clip_part, kl_part, entropy_part); }
};

ppo_train_reply combine_ppo_plan_replies(const std::vector<ppo_plan_train_reply>& replies);

}  // namespace troupe::actors
