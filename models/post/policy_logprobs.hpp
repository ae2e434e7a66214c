// policy_logprobs: a language model's per-token log-probabilities of sampled rows and the backward
// of a loss given as its gradient in them, the step shared by the RL objectives (GRPO:
// grpo_step.hpp, PPO: ppo_step.hpp). Rows are [B, T] i32 on the host: ids, and targets holding each
// completion token at the position that predicts it (-100 elsewhere).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "models/causal_lm.hpp"

namespace troupe::models {

// A view of host rows as i32 [rows, seq] (the vector must hold rows * seq).
tensor i32_rows(const std::vector<std::int32_t>& v, std::int64_t rows, std::int64_t seq);

// 1 where a target is trained on (not -100), per position.
std::vector<std::uint8_t> completion_mask(std::span<const std::int32_t> targets);

// The model's log-probability of every target (0 where it is -100): one forward of ids, targets
// i32 [B, T], left in place (logits) for backward_from_logprobs. Returns [B * T].
std::vector<double> token_logprobs_of(causal_lm& m, const tensor& ids, const tensor& targets);

// After token_logprobs_of(m, ids, targets): accumulates d(loss_scale * sum_n dlogp[n] logp[n]) /
// d params into m's gradients (the head's backward through trunk::set_logit_grads). Throws when
// the model cannot take the logits' gradient, naming `who`.
void backward_from_logprobs(causal_lm& m, const tensor& targets, std::span<const double> dlogp,
                            double loss_scale, const char* who);

}  // namespace troupe::models
