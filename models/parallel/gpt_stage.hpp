// gpt_stage: one pipeline rank's part of a GPT-2, stage<gpt_family> (stage.hpp) over GPT-2's
// tensor-parallel parts (parallelize_gpt.hpp): wte and wpe on virtual stage 0, the blocks h.<i>
// of each chunk, ln_f and the tied head on the last virtual stage (its own copy "wte.weight" when
// it is not stage 0, summed with stage 0's gradient by the runner).
#pragma once

#include "models/parallel/parallelize_gpt.hpp"
#include "models/parallel/stage.hpp"

namespace troupe::models::parallel {

extern template class stage<gpt_family>;
using gpt_stage = stage<gpt_family>;

}  // namespace troupe::models::parallel
