// rollout: sampling a group of completions per prompt with the kv cache, batched (all rows decode
// together), the rows GRPO trains on (grpo_step.hpp).
//
// Prompts have one length P (the caller pads or groups them so). Each prompt is repeated `group`
// times; rows decode together for max_new steps with temperature / top-p sampling
// (models/sampling.hpp; one sampler draws the rows in order, so a seed fixes the whole batch). A
// row that chose eos stops growing: later positions hold eos and are not trained on. The rows are
// [B = prompts x group, T = P + max_new]; targets carry the completion tokens (eos included) at
// the positions that predict them, -100 elsewhere.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/sampling.hpp"

namespace troupe::models {

struct rollout_options {
  std::int64_t group = 4;    // completions per prompt
  std::int64_t max_new = 8;  // tokens per completion at most
  sampling_options sampling;
  std::int32_t eos = -1;  // < 0: none (every completion is max_new long)
  std::uint64_t seed = 0;
};

struct rollout_rows {
  std::int64_t rows = 0, seq = 0, prompt_len = 0;
  std::vector<std::int32_t> ids, targets;  // [rows, seq]
  std::vector<std::int64_t> lengths;       // completion tokens per row (eos included)
  // The completion of row r: ids[r * seq + prompt_len ..][0 .. lengths[r]).
  std::span<const std::int32_t> completion(std::int64_t r) const {
    return {ids.data() + r * seq + prompt_len, static_cast<std::size_t>(lengths[r])};
  }
  std::int64_t new_tokens() const;
};

// prompts: [n, prompt_len] row-major. The model must hold n x group rows of P + max_new positions
// for generation (begin_generation).
rollout_rows sample_completions(causal_lm& model, std::span<const std::int32_t> prompts,
                                std::int64_t prompt_len, const rollout_options& opt);

}  // namespace troupe::models
