// dpo_step: Direct Preference Optimization on the trunk, as the trainer's micro-batch
// (models/trainer.hpp).
//
// A micro-batch of P pairs is one batch of 2P rows (chosen rows, then rejected:
// preference_data.hpp) run through the frozen reference model (forward only; no gradient) and the
// policy (the trained model). Each row's response log-probability logp_b (sequence_logprob.hpp;
// averaged over its response tokens for IPO, as TRL does) enters the DPO loss
// (preference_loss.hpp), whose gradient d loss / d logp_b becomes per-sequence weights w_b = -d
// loss / d logp_b of the policy's cross-entropy backward (trunk::set_sequence_weights), so one
// backward gives d loss / d params.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/post/preference_data.hpp"
#include "models/post/preference_loss.hpp"
#include "models/trainer.hpp"

namespace troupe::models {

// The DPO loss of one batch (ids, targets i32 [2P, T]: chosen rows then rejected), forward only.
// Leaves the policy's forward in place for a backward; `result` gets the loss, its gradients and
// TRL's metrics, `counts` the response tokens per row.
double dpo_forward(causal_lm& policy, causal_lm& reference, const tensor& ids,
                   const tensor& targets, const dpo_options& opt, dpo_result& result,
                   std::vector<std::int64_t>& counts);

// The micro-batch of draw d: `pairs` pairs of `rows`; on_result (optional) hears each batch's
// result. reference must outlive the function and be planned for [2 * pairs, rows->seq].
trainer::micro_batch dpo_micro_batch(std::shared_ptr<const preference_rows> rows,
                                     causal_lm& reference, std::int64_t pairs,
                                     const dpo_options& opt,
                                     std::function<void(const dpo_result&)> on_result = {});

}  // namespace troupe::models
