// llama_stage: stage<llama_family> instantiated (see llama_stage.hpp).
#include "models/parallel/llama_stage.hpp"

namespace troupe::models::parallel {

template class stage<llama_family>;

}  // namespace troupe::models::parallel
