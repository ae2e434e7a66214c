// ppo_step: PPO's two updates as trainer micro-batches (models/trainer.hpp): the policy's clipped
// objective and the critic's clipped value loss (ppo_loss.hpp) on a batch of sampled rows whose
// advantages and returns were computed beforehand (ppo_advantages.hpp).
//
// A batch is B rows (prompt then completion, padded to T): targets carry each completion token at
// the position that predicts it (-100 elsewhere); per position (0 off the targets): the sampling
// policy's log-probabilities, the whitened advantages, the critic's values at sampling time and
// the returns. The policy's forward gives its per-token log-probabilities and the loss's gradient
// in them goes back through the head (policy_logprobs.hpp); the critic's forward gives its values
// and the value loss's gradient (times vf_coef) goes back through the score (value_model.hpp).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "models/post/policy_logprobs.hpp"
#include "models/post/ppo_loss.hpp"
#include "models/post/value_model.hpp"
#include "models/trainer.hpp"

namespace troupe::models {

struct ppo_batch {
  std::int64_t rows = 0, seq = 0;
  std::vector<std::int32_t> ids, targets;    // [rows, seq]; targets -100 off the completions
  std::vector<double> old_logp, advantages;  // [rows * seq], for the policy
  std::vector<double> old_values, returns;   // [rows * seq], for the critic
};

// What a policy micro-batch saw: the loss and its metrics, and the mean entropy of the policy
// over the completion tokens (reported only).
struct ppo_policy_report {
  ppo_policy_result loss;
  double entropy = 0;
};

// The policy's loss on a batch (one forward, left in place for a backward).
ppo_policy_result ppo_policy_forward(causal_lm& policy, const ppo_batch& b, const ppo_options& opt);
// The critic's value loss (without vf_coef) on a batch (one forward, left in place).
ppo_value_result ppo_value_forward(value_model& critic, const ppo_batch& b, const ppo_options& opt);

// Micro-batches training on `*batch` (read at each call; the draw is not used). The critic's
// trainer must train critic.lm(); its loss is vf_coef * vf_loss. on_result hears each call.
trainer::micro_batch ppo_policy_micro_batch(
    std::shared_ptr<const ppo_batch> batch, const ppo_options& opt,
    std::function<void(const ppo_policy_report&)> on_result = {});
trainer::micro_batch ppo_value_micro_batch(
    std::shared_ptr<const ppo_batch> batch, value_model& critic, const ppo_options& opt,
    std::function<void(const ppo_value_result&)> on_result = {});

}  // namespace troupe::models
