// targets: the next-token targets that give HF's causal-LM loss with `labels=input_ids`, and the
// check every model's forward makes of a batch of ids and targets.
//
// HF shifts inside the model: loss = mean CE(logits[:, :-1], ids[:, 1:]) over B x (T-1) positions.
// Our models take explicit targets [B, T]; next_token_targets writes targets[b, t] = ids[b, t + 1]
// and ignore_index at t = T - 1, so the models' mean over non-ignored positions is exactly HF's.
#pragma once

#include <cstdint>
#include <string_view>

#include "models/layers/slots.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

// ids, targets: i32 [B, T] in host memory (targets may not alias ids).
void next_token_targets(const tensor& ids, const tensor& targets, std::int32_t ignore_index = -100);

// The [B, T] of a forward's batch: ids i32 [B, T], targets of the same shape, B and T at most the
// planned batch and seq. Errors start with `who` ("gpt: batch [4, 9] exceeds the planned [4, 8]").
batch_dims checked_batch(const tensor& ids, const tensor& targets, batch_dims planned,
                         std::string_view who);

}  // namespace troupe::models
