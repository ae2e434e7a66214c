// sft_step: the trainer's micro-batch for supervised fine-tuning (models/trainer.hpp): draw d
// reads rows d * batch .. of the packed SFT rows (sft_data.hpp), runs them with their segments and
// positions (trunk::set_packing) and backpropagates the mean loss over the assistant tokens.
//
// With grad_accum micro-batches per step the step's loss is the mean over all the assistant
// tokens of its grad_accum draws (step s: draws s * grad_accum ..), as one batch of them would
// give, not the mean of the micro-batches' means (which weighs a token of a micro-batch with few
// assistant tokens more): micro-batch k's loss and gradient are scaled by grad_accum * count_k /
// total, which the trainer's 1 / grad_accum turns into count_k / total.
#pragma once

#include <memory>

#include "models/post/sft_data.hpp"
#include "models/trainer.hpp"

namespace troupe::models {

// Throws (on the first call) when the model cannot run packed rows.
trainer::micro_batch sft_micro_batch(std::shared_ptr<const sft_rows> rows, std::int64_t batch,
                                     std::int64_t grad_accum = 1);

}  // namespace troupe::models
