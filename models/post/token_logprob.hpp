// token_logprob: the log-probability of each target token under a language model,
// logp[n] = log softmax(logits[n])[target[n]] (0 where the target is ignore_index), and the
// gradient of a per-token weighted sum back into the logits:
//   dlogits[n] = dlogp[n] * (onehot(target[n]) - softmax(logits[n]))   (0 on ignored rows)
// through the fused softmax cross-entropy op (tensor/ops.hpp), on the logits' device. GRPO's
// per-token ratios and KL (models/post/grpo_loss.hpp) are built on these.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tensor/tensor.hpp"

namespace troupe::models {

// logits [N, V] (floating), targets [N] (i32); losses: scratch of [N] in the logits' dtype (the
// op's saved statistics: f32 for 16-bit logits). Returns logp[n] for n < N.
std::vector<double> token_logprobs(const tensor& logits, const tensor& targets,
                                   const tensor& losses, std::int64_t ignore_index = -100);

// dlogits (like logits; may alias them) = d(sum_n dlogp[n] * logp[n]) / d logits; losses: scratch
// of at least one row.
void token_logprobs_backward(const tensor& logits, const tensor& targets,
                             std::span<const double> dlogp, const tensor& losses,
                             const tensor& dlogits, std::int64_t ignore_index = -100);

}  // namespace troupe::models
