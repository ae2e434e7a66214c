// sft_step: the trainer's micro-batch for supervised fine-tuning (models/trainer.hpp): draw d
// reads rows d * batch .. of the packed SFT rows (sft_data.hpp), runs them with their segments and
// positions (trunk::set_packing) and backpropagates the mean loss over the assistant tokens.
#pragma once

#include <memory>

#include "models/post/sft_data.hpp"
#include "models/trainer.hpp"

namespace troupe::models {

// Throws (on the first call) when the model cannot run packed rows.
trainer::micro_batch sft_micro_batch(std::shared_ptr<const sft_rows> rows, std::int64_t batch);

}  // namespace troupe::models
