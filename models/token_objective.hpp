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
#include <utility>
#include <vector>

namespace troupe::models {

struct token_loss {
  using entropy_fn = std::function<void(std::span<const double> entropy)>;
  // Constructors rather than an aggregate, so that token_loss{loss, dlogp} needs no on_entropy.
  token_loss() = default;
  token_loss(double l, std::vector<double> d, entropy_fn e = {})
      : loss(l), dlogp(std::move(d)), on_entropy(std::move(e)) {}
  double loss = 0;
  std::vector<double> dlogp;  // d loss / d logp per position of the micro-batch ([B * T])
  // Optional, for reporting only (it does not enter the gradient): the piece that holds the
  // logits then calls it, on every tensor shard, with each position's entropy of the softmax
  // over the whole vocabulary ([B * T], f64; models/parallel/vocab_entropy.hpp). Every head that
  // runs an objective honours it: tp_head and model_producer (PPO's entropy under a plan).
  entropy_fn on_entropy;
};

// logp: [B * T] (row-major, 0 at ignored targets), the same on every rank that calls it.
using token_objective = std::function<token_loss(std::span<const double> logp)>;

}  // namespace troupe::models
