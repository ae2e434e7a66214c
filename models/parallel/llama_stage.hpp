// llama_stage: one pipeline rank's part of a Llama, stage<llama_family> (stage.hpp) over Llama's
// tensor-parallel parts (parallelize_llama.hpp): embed_tokens on virtual stage 0, the layers
// layers.<i> of each chunk, norm and the head on the last virtual stage. With tie_embeddings the
// head is embed_tokens: the last stage, when it is not stage 0, holds its own copy
// "embed_tokens.weight" (the runner sums its gradient with stage 0's).
#pragma once

#include "models/parallel/parallelize_llama.hpp"
#include "models/parallel/stage.hpp"

namespace troupe::models::parallel {

extern template class stage<llama_family>;
using llama_stage = stage<llama_family>;

}  // namespace troupe::models::parallel
