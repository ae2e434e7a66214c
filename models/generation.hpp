// generation: continue a prompt token by token with the model's kv cache.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/sampling.hpp"

namespace troupe::models {

// Runs the prompt once, then samples up to max_new tokens one at a time (stopping after `eos`
// when eos >= 0, or when the model's max_seq is full). on_token (optional) sees each new id as it
// is chosen. Returns the new ids.
std::vector<std::int32_t> generate(causal_lm& model, std::span<const std::int32_t> prompt,
                                   std::int64_t max_new, token_sampler& sampler,
                                   std::int32_t eos = -1,
                                   const std::function<void(std::int32_t)>& on_token = {});

}  // namespace troupe::models
