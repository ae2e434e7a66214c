// grpo_roles: GRPO as an actor topology (issue 19). Four roles, each a role actor
// (actors/roles.hpp) holding its own model:
//   grpo_rollout   the policy's weights (as last pushed); samples groups of completions per prompt
//                  with the kv cache (models/post/rollout.hpp) and returns them with the sampling
//                  policy's per-token log-probabilities (GRPO's "old" ones). Several per job.
//   grpo_reward    a C++ reward function (e.g. a verifier) over (prompt, completion) tokens.
//   grpo_reference frozen weights (the checkpoint GRPO starts from): per-token log-probabilities
//                  for the KL term.
//   grpo_trainer   the policy and AdamW (models/trainer.hpp): one GRPO step per batch
//                  (models/post/grpo_step.hpp); pushes its weights to rollout actors as a
//                  versioned tensor message (version = optimizer steps done) over the data plane;
//                  saves them as an HF checkpoint on request.
// Every request and reply is a plain struct (actors/codec.hpp), so the roles can sit on any rank;
// the driver loop is actors/grpo_loop.hpp.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "actors/roles.hpp"

namespace troupe::actors {

// The reward of one completion (the tokens after the prompt, eos included when it was sampled).
using grpo_reward_fn =
    std::function<double(std::span<const std::int32_t> prompt, std::span<const std::int32_t>)>;

// Registers the four roles; `reward` is what grpo_reward actors compute.
void add_grpo_roles(role_registry& roles, grpo_reward_fn reward);

// Setup of a rollout or reference actor: the model of an HF checkpoint folder (config.json; the
// reference also loads its weights, a rollout waits for the trainer's), planned for rows x seq.
struct grpo_model_setup {
  std::string checkpoint;
  std::int64_t rows = 0, seq = 0;
  auto fields() { return std::tie(checkpoint, rows, seq); }
};

struct grpo_trainer_setup {
  grpo_model_setup model;  // weights loaded from the checkpoint
  double lr = 1e-4, weight_decay = 0.0, clip = 1.0, beta1 = 0.9, beta2 = 0.99;
  std::int64_t warmup = 0;
  double epsilon = 0.2, beta = 0.04;  // GRPO (models/post/grpo_loss.hpp)
  auto fields() {
    return std::tie(model, lr, weight_decay, clip, beta1, beta2, warmup, epsilon, beta);
  }
};

struct grpo_rollout_request {
  std::vector<std::int32_t> prompts;  // [n, prompt_len]
  std::int64_t prompt_len = 0, group = 4, max_new = 8;
  double temperature = 1.0, top_p = 1.0;
  std::int32_t eos = -1;
  std::uint64_t seed = 0;
  std::int64_t min_version = 0;  // refused when the actor's weights are older (staleness bound)
  // The actors (names) sharing the prompts, in order: actor i samples the i-th of equal parts,
  // with seed + i (empty: this actor samples them all). One request then serves all of them.
  std::vector<std::string> split;
  auto fields() {
    return std::tie(prompts, prompt_len, group, max_new, temperature, top_p, eos, seed, min_version,
                    split);
  }
};

// Sampled rows (models::rollout_rows) with the sampling policy's log-probabilities.
struct grpo_samples {
  std::int64_t rows = 0, seq = 0, prompt_len = 0;
  std::vector<std::int32_t> ids, targets;
  std::vector<std::int64_t> lengths;
  std::vector<double> old_logp;  // [rows * seq]
  std::int64_t version = -1;     // of the weights that sampled them
  double generate_seconds = 0, logprob_seconds = 0;
  auto fields() {
    return std::tie(rows, seq, prompt_len, ids, targets, lengths, old_logp, version,
                    generate_seconds, logprob_seconds);
  }
};

// The reference's per-token log-probabilities of samples' targets: a std::vector<double> reply.
struct grpo_reference_request {
  grpo_samples samples;
  auto fields() { return std::tie(samples); }
};
// The rewards of samples: a std::vector<double> reply, one per row.
struct grpo_reward_request {
  grpo_samples samples;
  auto fields() { return std::tie(samples); }
};

struct grpo_train_request {
  grpo_samples samples;
  std::vector<double> ref_logp;    // empty when beta is 0
  std::vector<double> advantages;  // one per row
  auto fields() { return std::tie(samples, ref_logp, advantages); }
};
struct grpo_train_reply {
  double loss = 0, kl = 0, clip_ratio = 0, grad_norm = 0, lr = 0, seconds = 0;
  std::int64_t version = 0;
  auto fields() { return std::tie(loss, kl, clip_ratio, grad_norm, lr, seconds, version); }
};

// Sends the trainer's weights to `to` (rollout actors); the reply comes once they hold them.
struct grpo_push_request {
  std::vector<role_handle> to;
  auto fields() { return std::tie(to); }
};
struct grpo_push_reply {
  std::int64_t version = 0, bytes = 0;
  double seconds = 0;
  auto fields() { return std::tie(version, bytes, seconds); }
};

// Saves the trainer's policy in HF layout (models::trainer::save: weights, config.json, the
// optimizer's state) into `dir`, replacing a troupe checkpoint there.
struct grpo_save_request {
  std::string dir;
  auto fields() { return std::tie(dir); }
};
struct grpo_save_reply {
  std::int64_t version = 0;  // the optimizer steps the saved weights hold
  std::int64_t held = -1;    // the step of the checkpoint the folder held before (-1: none)
  auto fields() { return std::tie(version, held); }
};

// A role's version of its weights (rollout: the last pushed, -1 before any).
struct grpo_version_request {
  std::uint8_t unused = 0;
};

}  // namespace troupe::actors
