// ppo_roles: PPO as an actor topology (issue 19). It reuses GRPO's rollout, reward and reference
// roles (grpo_roles.hpp: sampling with the pushed weights and the old log-probabilities, a C++
// reward function, the frozen reference's log-probabilities for the KL penalty) and adds two:
//   ppo_policy  the policy and AdamW (models/trainer.hpp): `epochs` steps of the clipped objective
//               (models/post/ppo_step.hpp) on each batch, then pushes its weights to the rollout
//               actors as GRPO's trainer does (grpo_push_request; version = optimizer steps done).
//   ppo_critic  the value model (models/post/value_model.hpp: the checkpoint's trunk with a new
//               score head, HF ...ForSequenceClassification layout) and its own AdamW: the values
//               of sampled rows, and `epochs` steps of the clipped value loss on each batch.
// Both save on a grpo_save_request (a grpo_save_reply back): the policy as GRPO's trainer does
// (HF causal LM layout), the critic in the reward model's layout (...ForSequenceClassification,
// what troupe rm saves and value_model loads), each folder replaced as one unit.
// The driver (actors/ppo_loop.hpp) computes the per-token rewards, GAE and returns between them
// (models/post/ppo_advantages.hpp). Every request and reply is a plain struct.
#pragma once

#include <cstdint>
#include <tuple>
#include <vector>

#include "actors/grpo_roles.hpp"

namespace troupe::actors {

// Registers GRPO's roles (add_grpo_roles, with `reward`) and ppo_policy and ppo_critic.
void add_ppo_roles(role_registry& roles, grpo_reward_fn reward);

// Setup of a ppo_policy or ppo_critic actor: the checkpoint's weights (the critic's score head
// initialised from `seed`, or the checkpoint's score.weight when it has one), AdamW, and PPO.
struct ppo_trainer_setup {
  grpo_model_setup model;
  double lr = 1e-4, weight_decay = 0.0, clip = 1.0, beta1 = 0.9, beta2 = 0.99;
  std::int64_t warmup = 0;
  std::int64_t epochs = 4;  // optimizer steps per batch (TRL's num_ppo_epochs)
  double cliprange = 0.2, cliprange_value = 0.2, vf_coef = 0.1;  // models/post/ppo_loss.hpp
  std::uint64_t seed = 0;
  bool need_score = false;  // the critic: refuse a checkpoint without score.weight (--critic DIR)
  auto fields() {
    return std::tie(model, lr, weight_decay, clip, beta1, beta2, warmup, epochs, cliprange,
                    cliprange_value, vf_coef, seed, need_score);
  }
};

// The critic's values of samples' rows: a std::vector<double> reply, [rows * seq], the value at
// each position that predicts a completion token (0 elsewhere).
struct ppo_value_request {
  grpo_samples samples;
  auto fields() { return std::tie(samples); }
};

struct ppo_policy_train_request {
  grpo_samples samples;            // with the sampling policy's log-probabilities
  std::vector<double> advantages;  // [rows * seq], whitened
  auto fields() { return std::tie(samples, advantages); }
};
struct ppo_critic_train_request {
  grpo_samples samples;
  std::vector<double> old_values, returns;  // [rows * seq]
  auto fields() { return std::tie(samples, old_values, returns); }
};

// Means over the epochs (the policy's loss is pg_loss, the critic's vf_coef * vf_loss); the
// critic leaves approx_kl and entropy 0.
struct ppo_train_reply {
  double loss = 0, clipfrac = 0, approx_kl = 0, entropy = 0, grad_norm = 0, lr = 0, seconds = 0;
  std::int64_t version = 0;  // optimizer steps done
  auto fields() {
    return std::tie(loss, clipfrac, approx_kl, entropy, grad_norm, lr, seconds, version);
  }
};

}  // namespace troupe::actors
