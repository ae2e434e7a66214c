// grpo_plan_trainer: GRPO's trainer under a parallel plan (issue 19). Instead of one grpo_trainer
// actor holding the whole policy, a grid of dp x pp x tp "grpo_plan_trainer" actors on ranks
// 0..G-1 (grid position = rank, the plan's grid order) each hold their piece of the policy in a
// models::parallel::hybrid_trainer over UCX communicators of those ranks. The driver
// (actors/grpo_loop.hpp) asks every one of them the same requests:
//   grpo_plan_setup     the run's train_config (TOML: the plan, AdamW, batch = the step's rows,
//                       model.hf = the checkpoint GRPO starts from) and GRPO's epsilon and beta
//   grpo_train_request  the step's whole batch of scored samples: every rank calls
//                       hybrid->step(grpo_samples(batch)) (models/post/plan_samples.hpp), which
//                       gives each dp replica its rows and each logit-holding piece its objective;
//                       the reply carries that rank's share of the step's KL and clip counts
//   grpo_push_request   the whole policy gathered from the pieces onto rank 0 (a flat buffer in
//                       the single-process model's layout: hybrid_trainer::gather_parameters),
//                       which sends it to the rollout actors as GRPO's trainer does (versioned)
//   grpo_save_request   hybrid_trainer::save: the plan checkpoint in HF layout
// Registered with add_grpo_roles' other roles by add_grpo_plan_trainer_role.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "actors/grpo_roles.hpp"
#include "actors/roles.hpp"

namespace troupe::actors {

void add_grpo_plan_trainer_role(role_registry& roles);

struct grpo_plan_setup {
  std::string config;  // models::to_toml of the trainer's train_config
  double epsilon = 0.2, beta = 0.04;
  auto fields() { return std::tie(config, epsilon, beta); }
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
grpo_train_reply combine_plan_replies(const std::vector<grpo_plan_train_reply>& replies);

}  // namespace troupe::actors
