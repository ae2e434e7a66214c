// vocab_entropy: the entropy of each position's softmax over the whole vocabulary when the logits
// are split by vocabulary columns over a tensor-parallel group (the vocab-parallel head,
// tp_vocab.hpp), for reporting (PPO's entropy under a plan, models/post/plan_samples.hpp). As the
// vocab-parallel cross entropy: a max allreduce of each row's largest logit, then one sum
// allreduce of the row's sum exp(z - M) and sum exp(z - M) z; H = M + log S - (sum e z) / S. In
// f64 from the logits' dtype, as models/post/ppo_loss.hpp's mean_token_entropy does for whole
// logits (with tp = 1 the two agree up to f64 summation order).
#pragma once

#include <vector>

#include "models/parallel/tp_mappings.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

// logits [N, V/tp] (this shard's columns; any floating dtype, any device) -> H[n] for each of the
// N rows, the same on every shard. Every shard of g must call it (collective).
std::vector<double> vocab_parallel_entropy(const tensor& logits, const tp_group& g);

}  // namespace troupe::models
