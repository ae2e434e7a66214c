// sequence_logprob: the log-probability of each sequence's response under a language model,
// logp_b = sum over the rows t of sequence b whose target is not ignore_index of
// log softmax(logits[b, t])[target[b, t]] (optionally divided by their count: `average`), and its
// gradient back into the logits:
//   dlogits[b, t] = dlogp_b * (onehot(target) - softmax(logits[b, t]))   (0 on ignored rows)
// through the fused softmax cross-entropy op (tensor/ops.hpp), on the logits' device.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tensor/tensor.hpp"

namespace troupe::models {

struct sequence_logprob_options {
  bool average = false;  // divide by the sequence's response tokens (TRL's IPO)
  std::int64_t ignore_index = -100;
};

// logits [B * T, V] (floating), targets [B * T] (i32) with the rows of sequence b at b*T..b*T+T-1;
// losses: scratch of [B * T] in the logits' dtype. Returns logp_b for b < B.
std::vector<double> sequence_logprobs(const tensor& logits, const tensor& targets, std::int64_t seq,
                                      const tensor& losses,
                                      const sequence_logprob_options& opt = {});

// dlogits (like logits; may alias them) = d(sum_b dlogp_b * logp_b) / d logits.
void sequence_logprobs_backward(const tensor& logits, const tensor& targets, std::int64_t seq,
                                std::span<const double> dlogp, const tensor& losses,
                                const tensor& dlogits, const sequence_logprob_options& opt = {});

}  // namespace troupe::models
