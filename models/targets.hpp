// targets: the next-token targets that give HF's causal-LM loss with `labels=input_ids`.
//
// HF shifts inside the model: loss = mean CE(logits[:, :-1], ids[:, 1:]) over B x (T-1) positions.
// Our models take explicit targets [B, T]; next_token_targets writes targets[b, t] = ids[b, t + 1]
// and ignore_index at t = T - 1, so the models' mean over non-ignored positions is exactly HF's.
#pragma once

#include <cstdint>

#include "tensor/tensor.hpp"

namespace troupe::models {

// ids, targets: i32 [B, T] in host memory (targets may not alias ids).
void next_token_targets(const tensor& ids, const tensor& targets, std::int32_t ignore_index = -100);

}  // namespace troupe::models
