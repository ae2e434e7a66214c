// grpo_step: a GRPO update on the trunk, as the trainer's micro-batch (models/trainer.hpp).
//
// A batch is B sampled rows (prompt then completion, padded to T): the completion positions carry
// their next token as target (-100 elsewhere), with the old log-probabilities (of the policy that
// sampled them), the reference's (for the KL; unused when beta is 0) and each row's group
// advantage. The policy's forward gives the per-token log-probabilities (token_logprob.hpp); the
// GRPO loss (grpo_loss.hpp) gives d loss / d logp per token, which the head's backward turns into
// the logits' gradient (trunk::set_logit_grads), so one backward gives d loss / d params.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/post/grpo_loss.hpp"
#include "models/post/policy_logprobs.hpp"
#include "models/trainer.hpp"

namespace troupe::models {

struct grpo_batch {
  std::int64_t rows = 0, seq = 0;
  std::vector<std::int32_t> ids, targets;  // [rows, seq]; targets -100 off the completions
  std::vector<double> old_logp, ref_logp;  // [rows * seq] (ref_logp empty when beta is 0)
  std::vector<double> advantages;          // [rows]
};

// The GRPO loss of a batch under `policy` (one forward, left in place for a backward).
grpo_result grpo_forward(causal_lm& policy, const grpo_batch& b, const grpo_options& opt);

// The micro-batch that trains on `*batch` (read at each call: the caller may refill it between
// steps; the draw is not used). on_result (optional) hears each call's result.
trainer::micro_batch grpo_micro_batch(std::shared_ptr<const grpo_batch> batch,
                                      const grpo_options& opt,
                                      std::function<void(const grpo_result&)> on_result = {});

}  // namespace troupe::models
