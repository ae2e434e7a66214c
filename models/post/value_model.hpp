// value_model: PPO's critic, a scalar value per token on the trunk. It is the reward model's layout
// (reward_model.hpp: HF's ...ForSequenceClassification with num_labels 1, the score head as the
// causal LM's extra head row), read at every position instead of one pooled token: TRL's value
// model is such a model, its values value[:, t] the score of the hidden state at position t.
// Position t's value estimates the return from the token that position predicts (TRL's
// values = full_value[:, context_length - 1 : -1]), so the values of a sampled row sit where its
// targets are (policy_logprobs.hpp). Save and load are the reward model's (score.weight).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

#include "models/post/reward_model.hpp"

namespace troupe::models {

class value_model {
 public:
  value_model(const hf::model_config& cfg, batch_dims dims, std::int32_t pad_id,
              dtype t = dtype::f32)
      : rm_(cfg, dims, pad_id, t) {}

  causal_lm& lm() { return rm_.lm(); }    // for the trainer
  reward_model& scored() { return rm_; }  // HF-layout save / load
  const reward_model& scored() const { return rm_; }

  // ids i32 [B, T] on the host: every position's value, [B * T]. Keeps what backward needs.
  std::vector<double> forward(const tensor& ids);
  // Accumulates d(loss_scale * sum_n dvalues[n] * value[n]) / d params (dvalues [B * T]).
  void backward(std::span<const double> dvalues, double loss_scale = 1.0);

 private:
  reward_model rm_;
  std::vector<std::int32_t> targets_;  // all ignored: the LM loss is not used
};

}  // namespace troupe::models
