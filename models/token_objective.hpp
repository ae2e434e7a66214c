// token_objective: a training objective over the per-token log-probabilities of a micro-batch, for
// post-training under every placement (models/post/plan_samples.hpp): the piece that computes the
// logits (the whole model, a tensor shard's vocab-parallel head, a pipeline's last stage) turns
// them into logp[n] = log softmax(logits[n])[target[n]] (0 where the target is ignored), the
// objective turns those into the micro-batch's loss and d loss / d logp[n], and the head's
// backward writes the logits' gradient sum_n dlogp[n] * d logp[n] / d logits: the cross-entropy
// backward with a weight of -dlogp[n] on row n. The single-process losses (grpo_loss, dpo_loss)
// are the objectives; nothing else changes between a single process and a plan.
#pragma once

#include <functional>
#include <span>
#include <vector>

namespace troupe::models {

struct token_loss {
  double loss = 0;
  std::vector<double> dlogp;  // d loss / d logp per position of the micro-batch ([B * T])
};

// logp: [B * T] (row-major, 0 at ignored targets), the same on every rank that calls it.
using token_objective = std::function<token_loss(std::span<const double> logp)>;

}  // namespace troupe::models
