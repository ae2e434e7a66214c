// ppo_job: everything `troupe ppo` is told (apps/cmd_ppo.cpp), from a TOML job file and/or
// command-line flags (flags win), read by the machinery troupe grpo's job shares
// (rl_job_file.hpp). Validated before anything starts; errors name the file and the key as
// "section.key", with its flag.
//
//   [model]       hf = "DIR" (an HF folder, e.g. troupe sft's checkpoint) or size = "llama-tiny"
//   [ppo]         the task, prompts and sampling as troupe grpo's [grpo] (task, digits,
//                 prompts_file, reward, template, tokenizer, steps, prompts_per_step,
//                 max_new_tokens, temperature, top_p, seed, rollouts, staleness, log_every), and
//                 samples_per_prompt (1 or more: PPO needs no group), epochs (optimizer steps per
//                 batch, policy and critic: TRL's num_ppo_epochs), kl_coef (the KL penalty in the
//                 per-token reward; 0: no reference actor), kl_estimator ("k1" or "k3"),
//                 whiten_rewards, gamma, lam (GAE), cliprange (the ratio's), cliprange_value,
//                 vf_coef (TRL's names and defaults, models/post/ppo_loss.hpp)
//   [critic]      hf = "DIR" (an HF ...ForSequenceClassification folder, e.g. what troupe rm saved;
//                 empty: the policy's trunk with a new score head), lr
//   [optim]       lr, warmup, weight_decay, clip, beta1, beta2 (the critic's too, but its lr)
//   [checkpoint]  dir (the policy, HF causal LM layout), critic_dir (the critic, reward-model
//                 layout; default "<dir>-critic"), every
//
// Keys of troupe train's job files that PPO does not read (train.batch, data.*, parallel.*) are
// refused by name, as unknown keys are: a PPO step's rows are prompts_per_step x
// samples_per_prompt.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "memory/error.hpp"

namespace troupe::models {

struct ppo_job {
  // [model]
  std::string model_hf;                   // an HF folder (config.json + safetensors)
  std::string model_size = "llama-tiny";  // a named size built from scratch (seeded)
  // [ppo]: the task and sampling (grpo_job's meanings)
  std::string task = "addition";  // "addition" or "prompts"
  std::int64_t digits = 1;
  std::string prompts_file;
  std::string reward = "exact";  // "exact" or "partial"
  std::string chat_template;     // "", "chatml" or "llama3"
  std::string tokenizer = "byte";
  std::int64_t steps = 20, prompts_per_step = 16, group = 8, max_new_tokens = 8;
  double temperature = 1.0, top_p = 1.0;
  std::uint64_t seed = 1;
  std::int64_t rollouts = 1, staleness = 0, log_every = 1;
  // [ppo]: PPO's own (TRL's defaults, but epochs: 4 there, 2 here as troupe_example_ppo)
  std::int64_t epochs = 2;
  double kl_coef = 0.05;
  std::string kl_estimator = "k1";  // "k1" or "k3"
  bool whiten_rewards = false;
  double gamma = 1.0, lam = 0.95;
  double cliprange = 0.2, cliprange_value = 0.2, vf_coef = 0.1;
  // [critic]
  std::string critic_hf;  // empty: the policy's trunk and a new score head
  double critic_lr = 1e-4;
  // [optim]: a constant rate after a linear warmup
  double lr = 1e-4, weight_decay = 0.0, clip = 1.0, beta1 = 0.9, beta2 = 0.99;
  std::int64_t warmup = 0;
  // [checkpoint]
  std::string ckpt_dir, critic_ckpt_dir;
  std::int64_t ckpt_every = 0;  // 0: only at the end (when dir is set)
  // [parallel]: the policy's plan under troupe launch (troupe train's keys; the flags --dp, --tp,
  // --pp, --zero, --microbatches, --sp override them): dp x tp x pp policy ranks (the critic
  // stays on rank 0)
  std::int64_t dp = 1, tp = 1, pp = 1, zero = 0, microbatches = 1;
  bool sp = false;

  // The critic's folder: critic_dir, or "<dir>-critic"; empty without checkpoint.dir.
  std::string critic_dir() const;
  // Checks ranges and combinations; the message names "section.key (--flag)".
  void validate() const;
  friend bool operator==(const ppo_job&, const ppo_job&) = default;
};

// Reads a TOML job file over the defaults; unknown sections or keys, wrong types and bad values
// are errors naming the file and "section.key". A file over 1 MiB is refused unread.
expected<ppo_job> load_ppo_job(const std::string& path);
// The same from TOML text; errors name `origin` as they would name the file.
expected<ppo_job> parse_ppo_job(std::string_view text, const std::string& origin);

}  // namespace troupe::models
