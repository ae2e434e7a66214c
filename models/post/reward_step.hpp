// reward_step: reward-model training (TRL's RewardTrainer) as the trainer's micro-batch
// (models/trainer.hpp): draw d's preference pairs (preference_data.hpp; chosen rows, then
// rejected) through the reward model (reward_model.hpp), the Bradley-Terry loss of their rewards
// (preference_loss.hpp), and its gradient back through the score into the model.
#pragma once

#include <functional>
#include <memory>

#include "models/post/preference_data.hpp"
#include "models/post/preference_loss.hpp"
#include "models/post/reward_model.hpp"
#include "models/trainer.hpp"

namespace troupe::models {

// The micro-batch of `pairs` pairs for a trainer of rm.lm(); rm must outlive the function.
// on_result (optional) hears each batch's loss and accuracy.
trainer::micro_batch reward_micro_batch(std::shared_ptr<const preference_rows> rows,
                                        reward_model& rm, std::int64_t pairs,
                                        std::function<void(const reward_result&)> on_result = {});

}  // namespace troupe::models
